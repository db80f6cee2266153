"""Layer 2, sequence: every seq, gap, restart, replay and continuity decision
(``sequencer``). No I/O: a ``Stream`` calls its ``Sink``."""
