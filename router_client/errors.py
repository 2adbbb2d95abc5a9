"""Errors raised by the router client.

    BalanceRouteError              base of everything this package raises on purpose
     +-- ParameterError            a parameter is out of range (names the parameter)
     +-- TraceError                a trace cannot be used
     |    +-- TraceFormatError     a line of a trace file is malformed (names file and line)
     +-- UnknownPolicyError        a policy name that no registry entry has
     +-- ContractError             a component broke its contract (a policy admitted a request
                                   twice, overfilled a worker, named a worker that does not
                                   exist; a view with a missing column); a bug, not bad input
"""

from __future__ import annotations


class BalanceRouteError(Exception):
    """Base class of the errors this package raises on purpose."""


class ParameterError(BalanceRouteError, ValueError):
    """A parameter is out of range; the message names it."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name
        self.detail = message


class TraceError(BalanceRouteError):
    """A trace cannot be used as a whole (unknown format, empty, unreadable)."""

    def __init__(self, source: str, message: str) -> None:
        super().__init__(f"{source}: {message}")
        self.source = source


class TraceFormatError(TraceError):
    """A line of a trace file is malformed."""

    def __init__(self, source: str, line: int, message: str) -> None:
        BalanceRouteError.__init__(self, f"{source}, line {line}: {message}")
        self.source = source
        self.line = line


class UnknownPolicyError(BalanceRouteError, KeyError):
    """A policy name that the registry does not know."""

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"unknown policy {name!r}; known: {', '.join(known)}")
        self.name = name

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class ContractError(BalanceRouteError, RuntimeError):
    """A component broke its contract: a bug in it, not bad input. Raised instead of
    ``assert`` (which ``python -O`` strips)."""
