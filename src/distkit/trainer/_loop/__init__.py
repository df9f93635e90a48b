"""The training loop as free functions, one concern per module (private): set-up and
teardown (setup), the epoch (epoch), one optimizer step (step) and the batch readers (batches),
non-finite steps and stop requests (nonfinite), SIGTERM (preemption), validation (evaluate),
validate/test/predict (inference), logging sums (logs), what checkpoints hold (state), the
start-up report (report), and how a model is called (model_io). trainer.py drives them."""
