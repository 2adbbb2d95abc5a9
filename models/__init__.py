"""SQLAlchemy 2.x tables of the prediction service (typed ``Mapped[...]`` columns)."""

from .tables import Base, Observation

__all__ = ["Base", "Observation"]
