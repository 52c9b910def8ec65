#!/usr/bin/env bash
# Installs the offline bundle (`make offline-bundle`, carried to this host as the repo's .device/)
# on a CUDA host that reaches no package registry: the wheels into $PREFIX/site with pip
# --no-index (the host's own torch, numpy, grpcio... stay as they are), Ray's trimmed tarball
# beside them with its exec bits, redis-server into $PREFIX/bin behind a wrapper that finds its
# libraries, and a `coxswain` command that runs this checkout. Nothing here uses the network.
#
#   deploy/offline/install.sh [BUNDLE]     BUNDLE: default the repo's .device/
#   PREFIX=/opt/coxswain-deps              where it installs (its own directory; rerun replaces)
#   PYTHON=python3                         the host's Python with CUDA PyTorch
set -euo pipefail

die() { echo "install.sh: $*" >&2; exit 1; }

repo=$(cd "$(dirname "$0")/../.." && pwd)
bundle=$(cd "${1:-$repo/.device}" 2>/dev/null && pwd) || die "no bundle at ${1:-$repo/.device}"
[ -f "$bundle/bundle.txt" ] || die "$bundle is not a bundle (no bundle.txt): make offline-bundle"
PREFIX=${PREFIX:-/opt/coxswain-deps}
PYTHON=$(command -v "${PYTHON:-python3}") || die "no ${PYTHON:-python3} on PATH (set PYTHON)"
site=$PREFIX/site
marker=$site/.coxswain-offline-bundle

want=$(sed -n 's/^python=//p' "$bundle/bundle.txt")
have=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$want" = "$have" ] || die "the bundle is for Python $want but $PYTHON is $have:" \
    "build it with \`make offline-bundle PYVER=$have\`"
"$PYTHON" -c 'import torch' 2>/dev/null || echo "warning: $PYTHON has no torch (not in the bundle)"

# Only a site this script made is replaced, so a PREFIX given by mistake loses nothing.
if [ -e "$site" ] && [ ! -e "$marker" ] && [ -n "$(ls -A "$site")" ]; then
    die "$site exists and was not made by install.sh: choose another PREFIX"
fi
rm -rf "$site" "$PREFIX/redis"
mkdir -p "$site" "$PREFIX/bin"
touch "$marker"

echo "== wheels -> $site"
"$PYTHON" -m pip install -q --no-index --no-deps --disable-pip-version-check \
    --target "$site" "$bundle"/wheels/*.whl

echo "== Ray -> $site"
# Python's tarfile rather than tar -J: no xz needed; the 'tar' filter keeps the exec bits.
"$PYTHON" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' \
    "$bundle/ray.tar.xz" "$site"
for b in raylet/raylet gcs/gcs_server; do
    [ -x "$site/ray/core/src/ray/$b" ] || die "ray/core/src/ray/$b is not executable"
done

echo "== redis-server -> $PREFIX/bin"
cp -r "$bundle/redis" "$PREFIX/redis"
cat > "$PREFIX/bin/redis-server" <<EOF
#!/bin/sh
# Debian's redis-server, with the jemalloc and lzf it was built against.
LD_LIBRARY_PATH="$PREFIX/redis/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" \\
    exec "$PREFIX/redis/bin/redis-server" "\$@"
EOF

pythonpath="$repo:$site"
cat > "$PREFIX/env.sh" <<EOF
# Coxswain from $repo, its packages from $site (before the host's own), redis-server.
export PYTHONPATH="$pythonpath\${PYTHONPATH:+:\$PYTHONPATH}"
export PATH="$PREFIX/bin:\$PATH"
EOF
command_for() {  # $PREFIX/bin/$1 runs the module $2 with the host's Python and env.sh
    cat > "$PREFIX/bin/$1" <<EOF
#!/bin/sh
. "$PREFIX/env.sh"
exec "$PYTHON" -m $2 "\$@"
EOF
}
command_for coxswain services.cli
command_for ray ray.scripts.scripts
chmod +x "$PREFIX"/bin/*

echo "== checks"
if ! "$PREFIX/bin/redis-server" --version; then
    LD_LIBRARY_PATH="$PREFIX/redis/lib" ldd "$PREFIX/redis/bin/redis-server" | grep 'not found' || true
    die "redis-server does not run here: install the libraries named above"
fi
PYTHONPATH="$pythonpath" "$PYTHON" -c "
import ray, ray.serve, fastapi, sse_starlette, pydantic, redis, gguf
import services.gateway.serve_app
print('ray', ray.__version__, 'and the gateway import')"

cat <<EOF

Installed. In each shell that runs Coxswain:
  source $PREFIX/env.sh
or
  export PYTHONPATH="$pythonpath\${PYTHONPATH:+:\$PYTHONPATH}"
  export PATH="$PREFIX/bin:\$PATH"
then, e.g.:
  coxswain up --tiny --device cuda
EOF
