"""Sequences, scheduler, block manager and the step loop of one serving instance."""
