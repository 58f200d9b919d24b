#!/usr/bin/env bash
# Builds a Tether runtime image WITHOUT pulling anything: assembles a minimal root filesystem from host-built release
# binaries (plus their shared libraries, bash for the healthchecks, CA certificates, a non-root user and the
# Fashion-MNIST files when the host has them) and `docker import`s it. The image behaves like the one
# docker/Dockerfile builds: binaries in /usr/local/bin, user tether (10001), /certs /ckpt /reports owned by it.
#
#   docker/build-rootfs.sh IMAGE [BIN_DIR]      # BIN_DIR defaults to target/release (build it first)
set -euo pipefail

image=${1:?usage: build-rootfs.sh IMAGE [BIN_DIR]}
root_dir=$(cd "$(dirname "$0")/.." && pwd)
bin_dir=${2:-${CARGO_TARGET_DIR:-$root_dir/target}/release}
dataset=${TETHER_DATASET_DIR:-/usr/share/datasets/fashion-mnist}
uid=10001

for b in tether-server tether-worker; do
  [ -x "$bin_dir/$b" ] || { echo "build-rootfs: $bin_dir/$b missing (cargo build --release -p $b)" >&2; exit 1; }
done
bash_bin=$(command -v bash)

rootfs=$(mktemp -d "${TMPDIR:-/tmp}/tether-rootfs.XXXXXX")
trap 'rm -rf "$rootfs"' EXIT

mkdir -p "$rootfs"/{bin,usr/local/bin,etc/tether,etc/ssl/certs,home/tether,certs,ckpt,reports,tmp,proc,sys,dev}
chmod 1777 "$rootfs/tmp"

# Binaries (debug info stripped: ~65 MB -> a few MB each) and bash (healthchecks, the certs one-shot).
for b in tether-server tether-worker; do
  strip -o "$rootfs/usr/local/bin/$b" "$bin_dir/$b"
done
cp -L "$bash_bin" "$rootfs/bin/bash"
ln -s bash "$rootfs/bin/sh"

# Shared libraries, at the paths the dynamic loader looks for them (libc, libm, libgcc_s, libtinfo, ld-linux).
for f in "$bin_dir/tether-server" "$bin_dir/tether-worker" "$bash_bin"; do
  ldd "$f" | awk '/=> \//{print $3} /^[[:space:]]*\//{print $1}'
done | sort -u | while read -r lib; do
  mkdir -p "$rootfs$(dirname "$lib")"
  cp -L "$lib" "$rootfs$lib"
done

cat > "$rootfs/etc/passwd" <<EOF
root:x:0:0:root:/root:/bin/bash
tether:x:$uid:$uid:tether:/home/tether:/bin/bash
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
cat > "$rootfs/etc/group" <<EOF
root:x:0:
tether:x:$uid:
nogroup:x:65534:
EOF
echo "hosts: files dns" > "$rootfs/etc/nsswitch.conf"
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/"
fi
cp "$root_dir/docker/cluster.toml" "$rootfs/etc/tether/cluster.toml"

if [ -d "$dataset" ]; then
  mkdir -p "$rootfs/usr/share/datasets"
  cp -r "$dataset" "$rootfs/usr/share/datasets/fashion-mnist"
else
  echo "build-rootfs: no $dataset; workers will fall back to the embedded digits set" >&2
fi

chown -R 0:0 "$rootfs"
chown "$uid:$uid" "$rootfs"/{home/tether,certs,ckpt,reports}

tar --numeric-owner -C "$rootfs" -c . | docker import \
  --change "USER $uid:$uid" \
  --change 'WORKDIR /home/tether' \
  --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' \
  --change 'CMD ["tether-server", "--help"]' \
  - "$image" >/dev/null
echo "built $image ($(du -sh "$rootfs" | cut -f1) root filesystem)"
