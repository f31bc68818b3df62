#!/bin/bash
# Find the packages vLLM VER's attention backends import on CPU, one ModuleNotFoundError at a time,
# in a throwaway venv (/tmp/mx-VER). Versions stay inside the release's own Requires-Dist ranges
# (constraints_from_meta.py). The result was frozen into tests/matrix/requirements/.
#
# usage: find_import_deps.sh VER FI_PIN TVM_PIN [seed pkgs...]
#   WHEELS=/dir/with/vllm-VER-*.whl (from `pip download --no-deps vllm==VER`), default /tmp/mx-wheels
#   e.g.   find_import_deps.sh 0.33.0 0.7.2.post1 0.1.11
set -u
V=$1; FI=$2; TVM=$3; shift 3
WHEELS=${WHEELS:-/tmp/mx-wheels}
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=/tmp/mx-$V
CONS=/tmp/mx-$V-constraints.txt
export UV_FIND_LINKS=/opt/wheels UV_COMPILE_BYTECODE=1
PY=$VENV/bin/python
if [ ! -x $PY ]; then
  uv venv -q $VENV -p 3.11
  uv pip install -q --python $PY 'torch==2.13.0+cpu'
  uv pip install -q --python $PY --no-deps $WHEELS/vllm-$V-*.whl "flashinfer-python==$FI"
fi
$PY -c "import packaging" 2>/dev/null || uv pip install -q --python $PY packaging
$PY "$HERE/constraints_from_meta.py" $WHEELS/vllm-$V-*.whl > $CONS
declare -A MAP=( [pynvml]=nvidia-ml-py [zmq]=pyzmq [cpuinfo]=py-cpuinfo [PIL]=pillow [yaml]=pyyaml [cv2]=opencv-python-headless [google]=protobuf [openai_harmony]=openai-harmony [oss_harmony]=oss-harmony [tvm_ffi]=apache-tvm-ffi [partial_json_parser]=partial-json-parser [prometheus_client]=prometheus-client [multipart]=python-multipart [dotenv]=python-dotenv [jwt]=pyjwt [sklearn]=scikit-learn [mistral_common]=mistral-common [sentencepiece]=sentencepiece [blake3]=blake3 [pybase64]=pybase64 [cbor2]=cbor2 [msgspec]=msgspec )
[ $# -gt 0 ] && uv pip install -q --python $PY -c $CONS "torch==2.13.0+cpu" "$@"
for i in $(seq 1 40); do
  out=$($PY -c 'import vllm.v1.attention.backends.flashinfer, vllm.v1.attention.backends.flash_attn, vllm.v1.attention.backends.cpu_attn, vllm.v1.attention.backends.registry, vllm.v1.kv_cache_interface' 2>&1)
  if [ $? -eq 0 ]; then echo "OK $V after $i"; break; fi
  mod=$(echo "$out" | grep -oP "No module named '\K[^'.]+" | tail -1)
  if [ -z "$mod" ]; then echo "$out" | tail -15; echo "STUCK"; break; fi
  pkg=${MAP[$mod]:-$mod}
  pkg=${pkg//_/-}
  echo "missing $mod -> $pkg"
  if [ "$pkg" = apache-tvm-ffi ]; then pkg="apache-tvm-ffi==$TVM"; fi
  uv pip install -q --python $PY -c $CONS "torch==2.13.0+cpu" "$pkg" 2>&1 | tail -3
  echo "$pkg" >> $VENV/added.txt
done
