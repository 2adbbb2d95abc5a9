"""BalanceRoute router client: the algorithm core, baselines, simulator and trace replay.

This package never imports :mod:`predictor`; predictions reach it through the small
:class:`router_client.predictors.Predictor` protocol.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
