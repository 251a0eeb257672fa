"""The demo: a small transformer LM that is preempted, requeued and resumed bit for bit."""
