"""SQLAlchemy 2.x tables of the prediction service (typed ``Mapped[...]`` columns)."""

from .tables import Base, Observation, ScoredPrediction

__all__ = ["Base", "Observation", "ScoredPrediction"]
