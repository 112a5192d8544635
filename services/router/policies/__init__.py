"""Routing policies: one file each behind the `Policy` interface in base.py."""

from services.router.policies.base import Choice, Policy, make_policy

__all__ = ["Choice", "Policy", "make_policy"]
