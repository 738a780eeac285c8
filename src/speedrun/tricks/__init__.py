"""One module per speed trick: a functional form and a docstring card (what, why, values, interactions, source).

Each trick is switched by a recipe config field, and tests/test_tricks.py checks that switching it off is an
exact no-op.
"""
