"""Placement: which worker runs which role. spec.py (the typed layout), strategies.py (APP's three strategies as
constructors, and `spec_from_config`), check.py (what cannot work, one line each, before anything starts).

Deliberately empty of imports: `import rlfuse.plan.spec` must load neither torch nor Ray (the single-process
path never imports Ray; the Ray launcher lives in its own module and imports Ray lazily).
"""
