"""The native CPU kernels: their C sources under `csrc/` (one header, `kvtier.h`), the build of
one shared library from them (`build.py`) and its ctypes interface checked against that header
(`abi.py`); torch-free (docs/architecture.md §Kernels)."""
