"""Errors raised by the router client.

    BalanceRouteError              base of everything this package raises on purpose
     +-- ParameterError            a parameter is out of range (names the parameter)
     +-- TraceError                a trace cannot be used
     |    +-- TraceFormatError     a line of a trace file is malformed (names file and line)
     +-- UnknownPolicyError        a policy name that no registry entry has
"""

from __future__ import annotations


class BalanceRouteError(Exception):
    """Base class of the errors this package raises on purpose."""


class ParameterError(BalanceRouteError, ValueError):
    """A parameter is out of range; the message names it."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name


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
