# Sourced by the benchmark scripts (bench_corpus.sh, bench_big.sh, bench_device_cpu.sh): write bytecode once
# for the packages every timed run imports, into PYTHONPYCACHEPREFIX (default /tmp/tracelens-pycache, so no
# installed tree is written to), and let the runs read it. Timings then leave out compiling source, which a
# Python with bytecode-less packages and PYTHONDONTWRITEBYTECODE set (the device image) repeats in every process.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/tracelens-pycache}
_bc_dirs=$(python3 -c "
import importlib.util, os
for m in ('numpy', 'pandas', 'pyarrow', 'msgspec', 'hta', 'plotly', 'networkx', 'tqdm', 'jinja2', 'pydot', 'psutil'):
    s = importlib.util.find_spec(m)
    if s and s.submodule_search_locations: print(list(s.submodule_search_locations)[0])
" 2>/dev/null)
# and the "before" checkout a benchmark compares with (EXTRA="--compare-root DIR"), so both sides read bytecode
_bc_cmp=$(printf '%s' "${EXTRA:-}" | sed -n 's/.*--compare-root[= ]\([^ ]*\).*/\1/p')
python3 -m compileall -q -j 0 tracelens reports moespec ${_bc_cmp:+$_bc_cmp/tracelens $_bc_cmp/reports $_bc_cmp/moespec} \
  $_bc_dirs >/dev/null 2>&1 || true
# and what the report derives from installed files (reports.common: the templates' Jinja2 bytecode, plotly.js
# packed), kept where Python keeps bytecode (the same prefix), for each checkout a run reads
for _bc_root in . ${_bc_cmp:+$_bc_cmp}; do
  (cd "$_bc_root" && python3 -c "
from reports.common import plotly_js_packed, template_env
for name in template_env().list_templates():
    template_env().get_template(name)
plotly_js_packed()" >/dev/null 2>&1) || true
done
unset _bc_dirs _bc_cmp _bc_root
