"""The step boundary behind `ddp_kit.init()`: what runs between two optimizer steps of any loop
(one class holds the schedule; each concern it schedules is a module of its own here). The services it
calls with plain arguments (watchdog, preemption, sync checks, ...) live in `ddp_kit.reliability`."""
