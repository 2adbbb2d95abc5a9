"""SQLAlchemy 2.x tables of the prediction service (typed ``Mapped[...]`` columns)."""

from .tables import AbJob, Base, Observation, ScoredPrediction

__all__ = ["AbJob", "Base", "Observation", "ScoredPrediction"]
