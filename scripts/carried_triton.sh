# Sourced by the GPU scripts: the newer Triton carried for the linear parts (scripts/triton_bundle.sh).
# carried_triton_path PY: unpacks .triton/triton-*-cp<PY's tag>.tar.xz once into $CARRIED_TRITON_DIR
# (default /tmp/carried_triton) and prints that directory (to go first on PYTHONPATH); prints nothing when no bundle for that python
# is carried. The rest of a session keeps the image's Triton.
carried_triton_path() {
  local py=$1 tag bundle dest=${CARRIED_TRITON_DIR:-/tmp/carried_triton}
  tag=$($py -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")') || return 0
  bundle=$(ls .triton/triton-*-cp"$tag".tar.xz 2>/dev/null | tail -n 1)
  [ -n "$bundle" ] || return 0
  if [ "$(cat "$dest/.bundle" 2>/dev/null)" != "$bundle" ]; then
    # python's own tarfile (lzma) first: the image may lack the xz program that tar -J calls
    rm -rf "$dest" && mkdir -p "$dest" && { $py -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
      "$bundle" "$dest" || tar -xJf "$bundle" -C "$dest"; } && echo "$bundle" > "$dest/.bundle" \
      || { echo "could not unpack $bundle" >&2; rm -rf "$dest"; return 0; }
  fi
  echo "$dest"
}
