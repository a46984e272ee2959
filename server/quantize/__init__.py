"""Quantized and lower-precision builds of a model, with a quality gate against FP32.

`api.build()` makes a *variant* model in the repository (`<model>-<engine>-<precision>`) from an
FP32 source: the artifact, a derived config.yaml and a build report. A version is published (made
servable) only when the build keeps the source's quality on held-out data (`quality.py`), so a
bad calibration can never replace a good model. Heavy libraries (torch, onnx, matplotlib) are
imported only when a build runs.

Each name is imported from the module that holds it (`api.build`, `ensure.ensure_built`,
`references.References`, `reporting.report`, `errors.BuildError`): this file imports nothing, so
no module of the package can import it back in a circle, and the server, which needs only
`ensure`, does not load the build code until a config declares a build.
"""
