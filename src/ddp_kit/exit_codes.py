"""Every exit code ddp_kit ends a process with, named once. No imports: the launchers and the templates they
render (launch/), the status command and the failure policy read the same numbers without importing torch.
What each code means to an engine, and which verdict it carries: reliability/verdicts.py."""

EXIT_FAILED = 1  # this rank's own failure (an exception, out of memory, the infrastructure): retryable
EXIT_PEER_FAILED = 1  # another rank failed first or vanished (dist/failfast.py): a failure like any other
EXIT_USER_ERROR = 2  # a user error, or the same failure at the same step twice: never worth a restart
EXIT_HANG = 3  # no progress within hang_timeout_s (reliability/watchdog.py): retryable
EXIT_PREEMPTED = 75  # EX_TEMPFAIL, "try again later": stopped on a signal and checkpointed; rerun to resume
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
