"""Walking a jaxpr, for tests that check what a traced program does (dtypes of its products,
what its kernels read and write)."""


def equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs inside it (custom rules, calls, loops, kernels)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for inner in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(inner, 'jaxpr', inner)
                if hasattr(inner, 'eqns'):
                    yield from equations(inner)
