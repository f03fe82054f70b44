#!/usr/bin/env bash
# Install (or remove) an Xronos service on this device.
#
#   sudo systemd/install.sh --role node|gateway [--root DIR] [--prefix DIR] [--source DIR]
#                           [--no-enable] [--skip-pip] [--uninstall]
#
# Install: the system user `xronos` (systemd-sysusers), a venv under PREFIX (/opt/xronos) with
# the package from the source checkout, /etc/xronos/<role>.toml from the commented template if
# absent (never overwritten), an empty /etc/xronos/mqtt_password (mode 0600) if absent, the unit
# in /etc/systemd/system, enabled (not started: edit the config first). Running it again only
# refreshes the venv and the unit.
# Uninstall: disables and removes the role's unit and config; the venv, the password file and
# the sysusers entry go with the last role. The state directory /var/lib/xronos-<role> and the
# user that owns it stay.
#
# --root DIR   operate on a system image at DIR (no running systemd is touched; systemctl and
#              systemd-sysusers work offline on it). The venv is built with this machine's
#              $PYTHON and then made to run at its final path inside the image: its interpreter
#              links, pyvenv.cfg and every script's shebang name PREFIX and the image's
#              /usr/bin/python3.X, not DIR. The image must have the same Python minor version
#              (and CPU architecture) as this machine; install.sh refuses a mismatch.
# --skip-pip   create the venv (without pip) but do not install the package: for tests of this
#              script and for images whose venv is filled later. The service cannot start until
#              the package is installed.
set -euo pipefail

ROLE="" ROOT="" PREFIX="/opt/xronos" UNINSTALL=0 ENABLE=1 SKIP_PIP=0
SOURCE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
# x86_64 wheels of torch on PyPI pull in CUDA (gigabytes); these boxes have no GPU.
# XRONOS_TORCH_INDEX=none: pip already finds a CPU torch (a local wheel, a mirror).
TORCH_INDEX="${XRONOS_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

die() { echo "install.sh: error: $*" >&2; exit 2; }
say() { echo "install.sh: $*"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --role) ROLE="${2:-}"; shift 2 ;;
        --root) ROOT="${2:-}"; shift 2 ;;
        --prefix) PREFIX="${2:-}"; shift 2 ;;
        --source) SOURCE="${2:-}"; shift 2 ;;
        --uninstall) UNINSTALL=1; shift ;;
        --no-enable) ENABLE=0; shift ;;
        --skip-pip) SKIP_PIP=1; shift ;;
        -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done

case "$ROLE" in node|gateway) ;; *) die "--role must be 'node' or 'gateway', got '${ROLE}'" ;; esac
case "$PREFIX" in /?*) ;; *) die "--prefix must be an absolute directory other than /, got '$PREFIX'" ;; esac
PREFIX="${PREFIX%/}"
if [ -n "$ROOT" ]; then
    [ -d "$ROOT" ] || die "--root '$ROOT' is not a directory"
    ROOT="$(cd "$ROOT" && pwd)"
    [ "$ROOT" = / ] && ROOT=""
fi
if [ -z "$ROOT" ] && [ "$(id -u)" != 0 ]; then
    die "run as root (sudo), or pass --root DIR to install into a system image"
fi

OTHER=$([ "$ROLE" = node ] && echo gateway || echo node)
UNIT="xronos-$ROLE.service"
UNIT_DIR="$ROOT/etc/systemd/system"
CONF_DIR="$ROOT/etc/xronos"
CONFIG="$CONF_DIR/$ROLE.toml"
PASSWORD="$CONF_DIR/mqtt_password"
SYSUSERS="$ROOT/etc/sysusers.d/xronos.conf"
DEST="$ROOT$PREFIX"
MARKER="$DEST/.installed-by-xronos"  # only a directory carrying it is ever deleted
ROOT_OPT=(); [ -n "$ROOT" ] && ROOT_OPT=(--root="$ROOT")

uninstall() {
    if [ -e "$UNIT_DIR/$UNIT" ] || [ -L "$UNIT_DIR/multi-user.target.wants/$UNIT" ]; then
        if [ -z "$ROOT" ]; then
            systemctl disable --now "$UNIT" || say "could not disable $UNIT (continuing)"
        else
            systemctl "${ROOT_OPT[@]}" disable "$UNIT" >/dev/null 2>&1 || true
            rm -f "$UNIT_DIR/multi-user.target.wants/$UNIT"
        fi
    fi
    rm -f "$UNIT_DIR/$UNIT" "$CONFIG"
    say "removed $UNIT and ${CONFIG#"$ROOT"}"
    if [ -e "$UNIT_DIR/xronos-$OTHER.service" ]; then
        say "xronos-$OTHER.service is still installed: keeping ${PREFIX}, ${PASSWORD#"$ROOT"} and the user"
    else
        if [ -e "$MARKER" ]; then rm -rf "$DEST"; say "removed $PREFIX"; fi
        rm -f "$PASSWORD" "$SYSUSERS"
        rmdir "$CONF_DIR" 2>/dev/null || true
    fi
    if [ -z "$ROOT" ]; then systemctl daemon-reload; fi
    say "kept the state directory /var/lib/xronos-$ROLE and the system user xronos"
}

node_id_guess() {
    # The host name, made a valid node_id: lowercase, [a-z0-9_-], at most 64 characters.
    local h
    h="$(cat "$ROOT/etc/hostname" 2>/dev/null || hostname)"
    h="$(printf '%s' "$h" | tr 'A-Z' 'a-z' | tr -c 'a-z0-9_-' '-' | cut -c1-64)"
    printf '%s' "${h:-node}"
}

relocate_venv() {
    # The venv was made at $DEST by this machine's Python; inside the image it lives at $PREFIX
    # and runs the image's $IMAGE_PY. Point the interpreter links, pyvenv.cfg and shebangs there.
    local venv="$DEST/venv" f
    for f in "$venv"/bin/python "$venv"/bin/python3 "$venv"/bin/python3.*; do
        [ -L "$f" ] || [ -e "$f" ] || continue
        rm -f "$f"
        ln -s "$IMAGE_PY" "$f"
    done
    sed -i -e "s#^home = .*#home = $(dirname "$IMAGE_PY")#" \
        -e "s#^executable = .*#executable = $IMAGE_PY#" \
        -e "s#^command = .*#command = $IMAGE_PY -m venv $PREFIX/venv#" "$venv/pyvenv.cfg"
    for f in "$venv"/bin/*; do
        [ -f "$f" ] && [ ! -L "$f" ] || continue
        if head -c 2 "$f" | grep -q '^#!'; then
            sed -i "1s#^\#!$venv/#\#!$PREFIX/venv/#" "$f"
        fi
        case "$(basename "$f")" in activate*) sed -i "s#$venv#$PREFIX/venv#g" "$f" ;; esac
    done
    if grep -rlsF "$ROOT" "$venv/bin" "$venv/pyvenv.cfg" >/dev/null; then
        die "--root: $PREFIX/venv still names $ROOT after relocation: $(grep -rlsF "$ROOT" "$venv/bin" | head -3)"
    fi
    say "venv made to run at $PREFIX/venv with the image's $IMAGE_PY"
}

install_files() {
    [ -f "$SOURCE/pyproject.toml" ] && [ -f "$SOURCE/systemd/$UNIT" ] \
        || die "--source '$SOURCE' is not an Xronos checkout (no pyproject.toml or systemd/$UNIT)"

    command -v systemd-sysusers >/dev/null || die "systemd-sysusers not found: is this a systemd system?"
    # 1. The service user, declared the systemd way so image builds get it too.
    install -d -m 0755 "$(dirname "$SYSUSERS")"
    printf 'u xronos - "Xronos fine-tuning" - -\n' >"$SYSUSERS"
    systemd-sysusers "${ROOT_OPT[@]}" >/dev/null

    # 2. The venv and the package.
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "$PYTHON is older than Python 3.11"
    IMAGE_PY=""
    if [ -n "$ROOT" ] && [ "$SKIP_PIP" = 0 ]; then
        local ours
        ours="$("$PYTHON" -c 'import sys; print("python%d.%d" % sys.version_info[:2])')"
        IMAGE_PY="/usr/bin/$ours"
        [ -x "$ROOT$IMAGE_PY" ] || die "--root: the image has no $IMAGE_PY (this machine's $PYTHON is $ours); \
the venv's compiled packages need the same Python minor version inside the image: install it there, or run \
install.sh inside the image, or set PYTHON to a matching interpreter"
    fi
    install -d -m 0755 "$DEST"
    touch "$MARKER"
    if [ "$SKIP_PIP" = 1 ]; then
        [ -x "$DEST/venv/bin/python" ] || "$PYTHON" -m venv --without-pip "$DEST/venv"
        say "--skip-pip: venv at $PREFIX/venv left empty; the package is NOT installed"
    else
        if [ -n "$IMAGE_PY" ] && [ -e "$DEST/venv/pyvenv.cfg" ]; then
            "$PYTHON" -m venv --upgrade "$DEST/venv"  # undo a previous relocation, to run it here
        fi
        [ -x "$DEST/venv/bin/pip" ] || "$PYTHON" -m venv "$DEST/venv"
        local spec="$SOURCE" extra=()
        if [ "$ROLE" = node ]; then
            spec="$SOURCE[node]"
            if [ "$(uname -m)" = x86_64 ] && [ "$TORCH_INDEX" != none ]; then
                extra=(--extra-index-url "$TORCH_INDEX")
            fi
        fi
        "$DEST/venv/bin/python" -m pip install --quiet --upgrade pip
        "$DEST/venv/bin/python" -m pip install --quiet "${extra[@]}" -c "$SOURCE/requirements.lock" "$spec"
        [ -n "$IMAGE_PY" ] && relocate_venv
        say "installed $(basename "$SOURCE") into $PREFIX/venv"
    fi

    # 3. Config: written once, never overwritten.
    install -d -m 0755 "$CONF_DIR"
    if [ -e "$CONFIG" ]; then
        say "kept existing ${CONFIG#"$ROOT"}"
    else
        sed "s/@NODE_ID@/$(node_id_guess)/g" "$SOURCE/systemd/$ROLE.toml.example" >"$CONFIG"
        chmod 0644 "$CONFIG"
        say "wrote ${CONFIG#"$ROOT"}: edit it (broker host, user)"
    fi
    if [ ! -e "$PASSWORD" ]; then
        # LoadCredential= needs the file to exist; empty = no password (anonymous broker).
        install -m 0600 /dev/null "$PASSWORD"
        say "created empty ${PASSWORD#"$ROOT"} (mode 0600): put the MQTT password in it"
    fi

    # 4. The unit (its ExecStart follows --prefix).
    install -d -m 0755 "$UNIT_DIR"
    sed "s#/opt/xronos/venv/#$PREFIX/venv/#g" "$SOURCE/systemd/$UNIT" >"$UNIT_DIR/$UNIT.tmp"
    chmod 0644 "$UNIT_DIR/$UNIT.tmp"
    mv -f "$UNIT_DIR/$UNIT.tmp" "$UNIT_DIR/$UNIT"
    if [ -z "$ROOT" ]; then systemctl daemon-reload; fi
    if [ "$ENABLE" = 1 ]; then
        systemctl "${ROOT_OPT[@]}" enable "$UNIT"
        say "enabled $UNIT; start it with: systemctl start $UNIT"
    else
        say "--no-enable: $UNIT installed but not enabled"
    fi
}

if [ "$UNINSTALL" = 1 ]; then uninstall; else install_files; fi
