"""Helpers every layer may use: strict parsing of untrusted input (:mod:`~jaxccl.util.strict`), text
reports and JSON results (:mod:`~jaxccl.util.report`), and the deprecated aliases of moved modules
(:mod:`~jaxccl.util.moved`). Nothing here imports another jaxccl package but :mod:`jaxccl.errors`."""
