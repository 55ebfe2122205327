"""Reusable contract suites: every implementation of a domain policy runs the same one."""
