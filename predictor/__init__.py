"""BalanceRoute prediction service and its online learners.

:mod:`predictor.estimators` holds plain numpy estimators and their registry (no web or
database code) that both
the service and the simulator use; :mod:`predictor.cli` is the composition root of the
``balanceroute`` command.
"""
