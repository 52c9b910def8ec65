#!/usr/bin/env bash
# `make offline-bundle`: builds, on a machine with internet access, what a CUDA host without any
# needs to run Coxswain beside its own PyTorch: the wheels of deploy/offline/requirements.txt,
# Ray trimmed to what Serve runs (ray.tar.xz: a tarball, as zip extraction drops the exec bits of
# raylet and gcs_server) and Debian's redis-server with its two libraries. Same architecture as
# the host (x86_64); redis-server comes from this machine's distribution, so build on a
# Debian/Ubuntu whose glibc is no newer than the host's. install.sh beside this file installs it.
set -euo pipefail
cd "$(dirname "$0")/../.."  # paths below are the repository's

PY=${PY:-python3}                # runs pip download; any version
PYVER=${PYVER:-3.12}             # the host's Python (major.minor)
OUT=${OUT:-.device}              # the bundle, to carry to the host
WORK=${WORK:-build/offline}      # scratch: the unpacked Ray, Debian packages, the import check
REQ=deploy/offline/requirements.txt
PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux_2_28_x86_64)

# Ray's parts that Serve never imports at run time: the Java jars, the ML libraries and the
# LLM serving layer built on them, the dashboard's web front end (`up` runs no dashboard).
RAY_TRIM=(ray/jars ray/rllib ray/data ray/tune ray/train ray/llm ray/serve/llm ray/dashboard/client)

say() { printf '== %s\n' "$*"; }

python_for_check() {  # a Python $PYVER on this machine to import the bundle with, if any
    local c
    for c in ${CHECK_PY:-} "python$PYVER"; do
        if "$c" -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$PYVER')" \
            2>/dev/null; then echo "$c"; return; fi
    done
    if command -v pyenv >/dev/null && c=$(pyenv latest "$PYVER" 2>/dev/null); then
        c="$(pyenv root)/versions/$c/bin/python$PYVER"
        [ -x "$c" ] && echo "$c"
    fi
}

rm -rf "$OUT" "$WORK"
mkdir -p "$OUT/wheels" "$WORK"

say "wheels for CPython $PYVER, manylinux x86_64 ($REQ)"
"$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp \
    --python-version "$PYVER" "${PLATFORMS[@]}" -d "$OUT/wheels" -r "$REQ"

say "Ray, trimmed to what Serve runs"
ray_wheel=$(ls "$OUT"/wheels/ray-*.whl)
mv "$ray_wheel" "$WORK/"
"$PY" - "$WORK/$(basename "$ray_wheel")" "$WORK/ray" <<'EOF'
import os, sys, zipfile
# Unzip keeping each file's mode: the wheel records raylet and gcs_server as executable.
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        path = z.extract(info, sys.argv[2])
        mode = info.external_attr >> 16
        if mode:
            os.chmod(path, mode & 0o7777)
EOF
(cd "$WORK/ray" && rm -rf "${RAY_TRIM[@]}" && find . -type d -name tests -prune -exec rm -rf {} +)
if command -v strip >/dev/null; then
    elf=$(printf '\177ELF')
    while IFS= read -r -d '' f; do
        [ "$(head -c 4 "$f")" = "$elf" ] && strip --strip-unneeded "$f"
    done < <(find "$WORK/ray" -type f \( -name '*.so' -o -name '*.so.*' -o -perm -u+x \) -print0)
else
    echo "no strip here: Ray's binaries stay unstripped (about 40 MB more before compression)"
fi
for b in raylet/raylet gcs/gcs_server; do
    [ -x "$WORK/ray/ray/core/src/ray/$b" ] || { echo "ray/core/src/ray/$b is not executable"; exit 1; }
done
(cd "$WORK/ray" && tar -cf - ray ray-*.dist-info) | xz -9 -T0 > "$OUT/ray.tar.xz"

say "redis-server from $(. /etc/os-release && echo "$PRETTY_NAME")"
command -v apt-get >/dev/null && command -v dpkg >/dev/null \
    || { echo "redis-server comes from Debian packages: build on Debian or Ubuntu"; exit 1; }
mkdir -p "$WORK/deb" "$OUT/redis/bin" "$OUT/redis/lib" "$OUT/redis/doc"
# redis-server is a link to redis-check-rdb (redis-tools), which runs as whichever it is named.
(cd "$WORK/deb" && apt-get download -q redis-server redis-tools libjemalloc2 liblzf1 >/dev/null) \
    || { echo "apt-get download failed: run apt-get update first"; exit 1; }
for deb in "$WORK"/deb/*.deb; do dpkg -x "$deb" "$WORK/deb/root"; done
root=$WORK/deb/root
cp "$root/usr/bin/redis-check-rdb" "$OUT/redis/bin/redis-server"
cp -L "$root"/usr/lib/x86_64-linux-gnu/{libjemalloc.so.2,liblzf.so.1} "$OUT/redis/lib/"
for pkg in redis-tools libjemalloc2 liblzf1; do
    cp "$root/usr/share/doc/$pkg/copyright" "$OUT/redis/doc/$pkg.copyright"
done
redis_version=$(dpkg-deb -f "$WORK"/deb/redis-tools_*.deb Version)

cat > "$OUT/bundle.txt" <<EOF
python=$PYVER
platform=linux-x86_64
ray=$(basename "$ray_wheel" | cut -d- -f2)
redis=$redis_version
redis_from=$(. /etc/os-release && echo "$PRETTY_NAME")
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
EOF

check_py=$(python_for_check)
if [ -n "$check_py" ]; then
    say "import check with $check_py"
    # The bundle beside the host's packages (from PyPI here; not torch, which the check skips).
    host=$(sed -n 's/^# host: //p' "$REQ" | tr ' ' '\n' \
        | grep -vxE 'torch|safetensors|tokenizers|matplotlib|scipy' | tr '\n' ' ')
    export PIP_ROOT_USER_ACTION=ignore
    "$check_py" -m pip install -q --target "$WORK/check" --no-deps "$OUT"/wheels/*.whl
    # shellcheck disable=SC2086  # split into one package a word
    "$check_py" -m pip install -q --target "$WORK/host" $host
    tar -xJf "$OUT/ray.tar.xz" -C "$WORK/check"
    PYTHONPATH="$PWD:$WORK/check:$WORK/host" "$check_py" -c "
import ray, ray.serve, ray.dashboard.optional_deps, ray.scripts.scripts
import fastapi, sse_starlette, uvicorn, pydantic, redis, gguf
import grpc_health.v1.health, grpc_reflection.v1alpha.reflection
import services.proto.coxswain.v1.engine_pb2_grpc
print('ray', ray.__version__, 'imports ray.serve and the gateway stack')"
    LD_LIBRARY_PATH="$OUT/redis/lib" "$OUT/redis/bin/redis-server" --version
else
    echo "no Python $PYVER here (set CHECK_PY): the bundle is built but not import-checked"
fi

say "sizes (bytes)"
wheels=$(du -cb "$OUT"/wheels/*.whl | tail -1 | cut -f1)
ray=$(du -b "$OUT/ray.tar.xz" | cut -f1)
redis=$(du -sb "$OUT/redis" | cut -f1)
total=$(du -sb "$OUT" | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
printf '  wheels      %10d (%d files)\n  ray.tar.xz  %10d\n  redis       %10d\n' \
    "$wheels" "$(ls "$OUT"/wheels | wc -l)" "$ray" "$redis"
awk -v b="$total" -v t="$tree" 'BEGIN {
    printf "  bundle      %10d (%.1f MiB)\n  + the repo  %10d = %.1f MiB\n", b, b / 2^20, t, (b + t) / 2^20 }'
if [ $((total + tree)) -gt $((64 * 1048576)) ]; then
    echo "note: bundle + repo exceed 64 MiB, more than one transfer of the device tool"
fi
