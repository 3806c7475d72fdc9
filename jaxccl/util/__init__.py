"""Helpers every layer may use: strict parsing of untrusted input (:mod:`~jaxccl.util.strict`), text
reports and JSON results (:mod:`~jaxccl.util.report`), the deprecated aliases of moved modules
(:mod:`~jaxccl.util.moved`) and the check of keywords that pick a variant (:mod:`~jaxccl.util.options`).
Nothing here imports another jaxccl package but :mod:`jaxccl.errors`."""
