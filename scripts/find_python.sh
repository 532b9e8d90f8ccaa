#!/usr/bin/env bash
# Print the path of a working Python >= 3.12, bootstrapping CPython 3.13 from Debian's source
# package into $K3JAX_CACHE/python when the machine has none (Debian 12 ships only 3.11).
set -euo pipefail
cache="${K3JAX_CACHE:-$HOME/.cache/k3jax}"

works() {  # a candidate counts only if it runs and is >= 3.12 (pyenv shims exist but may fail)
  "$1" -c 'import sys, ssl, sqlite3, zlib, lzma, bz2, ctypes; sys.exit(sys.version_info < (3, 12))' \
    >/dev/null 2>&1
}

for candidate in "$cache/python/bin/python3.13" python3.13 python3.12 python3 \
    "$HOME"/.pyenv/versions/3.13*/bin/python3.13 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
  path=$(command -v "$candidate" 2>/dev/null || true)
  if [ -n "$path" ] && works "$path"; then echo "$path"; exit 0; fi
done

echo "k3jax: no Python >= 3.12 found; building CPython 3.13 from Debian's source package into $cache/python (~2-5 min)" >&2
build="$cache/python-src"
mkdir -p "$build"
uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[ -n "$uri" ] || uri=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
[ -n "$uri" ] || uri=http://deb.debian.org/debian
echo "deb-src $uri trixie main" > /etc/apt/sources.list.d/k3jax-trixie-src.list
apt-get update -qq >&2
apt-get install -y -qq build-essential libssl-dev zlib1g-dev libbz2-dev liblzma-dev libsqlite3-dev \
  libffi-dev libreadline-dev uuid-dev >&2
(cd "$build" && apt-get source --download-only python3.13 >&2)
tarball=$(ls "$build"/python3.13_*.orig.tar.xz | head -n 1)
tar -xf "$tarball" -C "$build"
src=$(find "$build" -maxdepth 1 -type d -name 'Python-3.13*' | head -n 1)
(cd "$src" && ./configure --prefix="$cache/python" >&2 && make -j"$(nproc)" >&2 && make install >&2)
"$cache/python/bin/python3.13" -m ensurepip >&2
works "$cache/python/bin/python3.13"
echo "$cache/python/bin/python3.13"
