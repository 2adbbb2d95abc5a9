"""``python -m predictor.estimators._fit_main``: the hazard fit worker's entry point
(:func:`predictor.estimators.fit_worker.main`). A module of its own, which the package does
not import, so that running it does not execute a module already imported."""

from predictor.estimators.fit_worker import main

if __name__ == "__main__":
    main()
