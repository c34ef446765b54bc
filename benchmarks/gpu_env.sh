# Sourced by the multi-GPU benchmark scripts (bench_ep.sh, record_4gpu_fixtures.sh) on the GPU machine: NVLink
# multicast off (the device tool's rule), unbuffered Python, the carried .whl folder's wheels (PyYAML for the
# trainer; msgspec, jinja2, plotly for tracelens) when the image lacks them (it has torch, triton, numpy, pandas,
# pyarrow, click), and this checkout first on PYTHONPATH.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ! python3 -c "import yaml, msgspec, jinja2, plotly" 2>/dev/null; then  # the trainer and tracelens
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null \
    || python3 -m pip install -q --no-index --no-deps --target /tmp/site --find-links .whl pyyaml
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
