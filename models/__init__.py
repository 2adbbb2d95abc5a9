"""SQLAlchemy 2.x tables of the prediction service (typed ``Mapped[...]`` columns)."""

from .tables import AbJob, Base, LearnerSnapshot, Observation, ScoredPrediction

__all__ = ["AbJob", "Base", "LearnerSnapshot", "Observation", "ScoredPrediction"]
