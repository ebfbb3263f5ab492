"""Generated stubs of the refit.v1 control-plane API (proto/refit/v1/refit.proto).

Do not edit refit_pb2*.py by hand: run `python proto/generate.py`.
"""
