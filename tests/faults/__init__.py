"""Fault injection: scenarios that break locks on purpose, the histories they record, and the checker."""
