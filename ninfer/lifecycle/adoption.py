"""Adoption: when a new request may take over a detached prefill's lane in place.

One rule, used by the scheduler to find the detached prefill a waiting request adopts and
by the `adopt` transition's guard. Call it through this module (`adoption.refusal`) so
that one definition governs both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import Request


def refusal(detached: Request, adopter: Request) -> str | None:
    """Why `adopter` may not take over `detached`'s lane, or None when it may: the lane's
    state covers `detached`'s prompt up to its cursor, so the adopter must be of the same
    tenant, fresh, and its prompt must start with the whole detached prompt."""
    if detached.state != "Detached":
        return f"request {detached.id} is {detached.state}, not detached"
    if adopter.tenant != detached.tenant:
        return "another tenant's prefill"
    if adopter.outputs:
        return "the adopter has decoded already"
    n = len(detached.prompt)
    if len(adopter.prompt) < n or adopter.prompt[:n] != detached.prompt:
        return "the adopter's prompt does not extend the detached prompt"
    return None
