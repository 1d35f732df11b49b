"""Conformance runs: real client processes against a configured backend, their histories, and the checker.

``manage.py distlock verify --using ALIAS`` runs the scenarios of ``distlock.conformance.scenarios``
against a deployment; the fault-injection suite of the test tree runs the same scenarios, and more,
against servers it breaks on purpose.
"""
