"""One module per benchmark suite (`<name>.py`, `-` in a suite name becomes `_`).

Modules are imported on demand by `memjax.bench.harness.get_suite`, and each registers its
`run(ctx)` with `@harness.register('<name>')`. Add a suite by adding a module here.
"""
