#!/usr/bin/env bash
# Set up everything hicache-draft needs in a virtual environment: the core, every plugin in this
# repository, the example third-party backend, and (with --test) the test tools and SGLang's
# interface package. Idempotent: a second run only re-checks.
#
#   scripts/setup.sh          # for the demo
#   scripts/setup.sh --test   # for the test suite
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
TORCH_PIN="torch==2.13.0"          # the CPU build on this kind of machine; unpinned torch pulls CUDA
MOONCAKE_EXTRA=${MOONCAKE_EXTRA:-cpu}  # "cuda" on CUDA hosts
SGLANG_PIN="sglang==0.5.23"
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

# System packages: the Mooncake client needs Debian's libibverbs1 (even over TCP); the core's compiled
# data plane (hicache_draft/_native.c) needs a C compiler and the xxHash header (libxxhash-dev).
apt_want=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || apt_want+=(libibverbs1 libnuma1 libcurl4)
[ -f /usr/include/xxhash.h ] || apt_want+=(libxxhash-dev)
command -v cc >/dev/null || apt_want+=(gcc libc6-dev)
if [ ${#apt_want[@]} -gt 0 ]; then
  say "installing ${apt_want[*]} (Mooncake's client library, the compiled data plane)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_want[@]}" >/dev/null
fi

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      PY=$cand; break
    fi
  done
fi
[ -n "$PY" ] || { echo "error: Python 3.11+ is required" >&2; exit 1; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtual environment $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

dists=()
for d in plugins/*/ examples/*/; do
  d=${d%/}
  [ -f "$d/pyproject.toml" ] || continue
  if [ "$d" = plugins/mooncake ]; then dists+=(-e "$d[$MOONCAKE_EXTRA]"); else dists+=(-e "$d"); fi
done

stamp="$VENV/.hicache-draft-setup"
extras=""
[ $want_test = 1 ] && extras="[test]"
# the compiled module is built by the (editable) install: its sources are part of the fingerprint
fingerprint=$(cat pyproject.toml plugins/*/pyproject.toml examples/*/pyproject.toml hicache_draft/_native*.[ch] \
  2>/dev/null | sha256sum | cut -c1-16)
fingerprint="$fingerprint-$want_test"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$fingerprint" ]; then
  say "environment $VENV is up to date"
else
  say "installing hicache-draft$extras ($TORCH_PIN) and ${dists[*]//-e /}"
  "${PIP[@]}" "$TORCH_PIN" -e ".$extras" "${dists[@]}"
  if [ $want_test = 1 ]; then
    say "installing $SGLANG_PIN without its dependencies (its storage interface only)"
    "${PIP[@]}" --no-deps "$SGLANG_PIN" 2>&1 | grep -v "dependency resolver" || true
  fi
  echo "$fingerprint" > "$stamp"
fi

# SGLang's own controllers and host pools for tests/sglang_real (--test only): each older release in
# its own --target directory (the pinned one is the venv's), the pure packages its modules import in a
# shared directory that only those test processes put on sys.path (tests/sglang_real/bootstrap.py).
SGLANG_RELEASES="0.5.18 0.5.19 0.5.21 0.5.22"
SGLANG_OLD_HF="transformers==5.12.1 tokenizers==0.22.2 huggingface_hub>=1.5,<2"  # what 0.5.18-0.5.21 pin
SGLANG_DEPS="numpy orjson psutil pybase64 pillow starlette msgspec pyzmq transformers==5.19.0 dill sentencepiece==0.2.1 gguf loguru openai==2.6.1"
SGLANG_DEPS_NODEPS="compressed-tensors==0.18.0 apache-tvm-ffi==0.1.11 partial_json_parser xgrammar==0.2.1"
if [ $want_test = 1 ]; then
  sgdir="$VENV/sglang"
  sgstamp="$sgdir/.setup"
  sgprint=$(printf '%s|%s|%s|%s' "$SGLANG_RELEASES" "$SGLANG_OLD_HF" "$SGLANG_DEPS" "$SGLANG_DEPS_NODEPS" | sha256sum | cut -c1-16)
  if [ -f "$sgstamp" ] && [ "$(cat "$sgstamp")" = "$sgprint" ]; then
    say "SGLang releases for tests are up to date ($SGLANG_RELEASES)"
  else
    say "installing SGLang $SGLANG_RELEASES for tests (--no-deps, one directory each) and their module imports"
    rm -rf "$sgdir" && mkdir -p "$sgdir"
    quiet() { grep -v -e "dependency resolver" -e "requires" -e "incompatible" -e "Location" || true; }
    "${PIP[@]}" --target "$sgdir/_deps" $SGLANG_DEPS 2>&1 | quiet
    # shellcheck disable=SC2086
    "${PIP[@]}" --no-deps --target "$sgdir/_deps" $SGLANG_DEPS_NODEPS 2>&1 | quiet
    pids=()
    for rel in $SGLANG_RELEASES; do
      extra=""
      case $rel in 0.5.18|0.5.19|0.5.20|0.5.21) extra=$SGLANG_OLD_HF;; esac
      # shellcheck disable=SC2086
      ("${PIP[@]}" --no-deps --target "$sgdir/$rel" "sglang==$rel" $extra 2>&1 | quiet) &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
    for rel in $SGLANG_RELEASES; do
      [ -d "$sgdir/$rel/sglang" ] || { echo "error: sglang $rel did not install into $sgdir/$rel" >&2; exit 1; }
    done
    echo "$sgprint" > "$sgstamp"
  fi
fi
say "ready: $VENV/bin/hicache-draft ($("$VENV/bin/python" -c 'import hicache_draft; print(hicache_draft.__version__)'))"
