"""Freed host memory stays mapped: a CPU attention step stops faulting its K/V gathers in again."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# page faults over 20 batch-32 decode attention steps, with or without retain_freed_memory()
SCRIPT = """
import resource, torch
if {retain}:
    from backend.host_memory import retain_freed_memory
    assert retain_freed_memory()
from specserve_kernels.paged_attention import paged_attention_ref
torch.set_num_threads(1)
k_cache = torch.randn(600, 16, 2, 64)
v_cache = torch.randn_like(k_cache)
tables = torch.arange(1, 513, dtype=torch.int32).view(32, 16)
cu_seqlens = torch.arange(33, dtype=torch.int32)
seq_lens = torch.full((32,), 256, dtype=torch.int32)
q = torch.randn(32, 6, 64)
paged_attention_ref(q, k_cache, v_cache, cu_seqlens, seq_lens, tables, 0.125)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    paged_attention_ref(q, k_cache, v_cache, cu_seqlens, seq_lens, tables, 0.125)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(retain: bool) -> int:
    # glibc's default mmap threshold (128 KiB), made static: left alone, glibc raises it by itself
    # after freeing a large mmapped block, at a moment that varies from run to run, and the
    # baseline's count with it (4,089-15,233 faults over runs, against ~41,000 with this)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(retain=retain)], cwd=REPO,
                         check=True, capture_output=True, text=True, timeout=120, env=env)
    return int(out.stdout.strip().splitlines()[-1])


def test_retained_memory_cuts_page_faults_of_attention_steps():
    without, retained = _page_faults(False), _page_faults(True)
    assert retained < 0.25 * without, (retained, without)
