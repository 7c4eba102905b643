# The compiled extension service/compute/fastpath.c (built by setup.py). Its signature and limits are
# service/compute/fastpath.py's;
# tests/service/test_fastpath_contract.py holds this stub's names equal to the compiled module's.
from indexer_service.service.compute.fastpath import BuildChunk

build_chunk: BuildChunk
# FastPathLimits' fields, in the order the C file reads them (by name).
limit_fields: tuple[str, ...]
