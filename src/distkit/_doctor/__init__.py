"""The hang doctor (private): the watchdog thread and the store protocol of a job's ranks
(:mod:`.doctor`), where each thread is and whether it waits (:mod:`.where`), and the report that
names the odd rank and its line (:mod:`.report`). Public through ``distkit.init(hang_timeout_s=...)``,
the Trainer's ``hang_timeout_s`` and docs/debugging.md."""
