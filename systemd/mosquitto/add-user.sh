#!/usr/bin/env bash
# Give one Xronos device (or person) its MQTT user and its ACL block on a Mosquitto broker.
#
#   sudo systemd/mosquitto/add-user.sh ROLE NAME [--passwd FILE] [--acl FILE] [--base TOPIC]
#                                      [--no-password]
#   sudo systemd/mosquitto/add-user.sh --remove NAME [--passwd FILE] [--acl FILE]
#
# ROLE is one of
#   gateway        the Xronos gateway: all of {base}/#, writes Home Assistant discovery
#   node           a node; NAME must equal node_id in its node.toml: only {base}/node/NAME/...,
#                  writing its reports and reading its commands (not the other way round)
#   homeassistant  Home Assistant: reads {base}/#, writes only the command topics .../set, and
#                  its own discovery tree homeassistant/# (reads discovery, writes its status)
#   cli            a person or script running `xronos job|nodes`: reads {base}/#, sends requests
#   keep           an existing user of the broker (zigbee2mqtt, ...) keeps the full access it had
#                  before the broker had an ACL file (`readwrite #` and `read $SYS/#`); no password
#
# The password is asked for by mosquitto_passwd (twice; it reads stdin when that is not a
# terminal). --no-password only writes the ACL block (for a user the broker already has).
# Each block sits between `# xronos-user NAME` markers: running the script again for NAME
# replaces its block and password; nothing outside the markers is touched, so other users'
# rules and passwords stay as they were. Defaults: /etc/mosquitto/xronos.passwd and
# /etc/mosquitto/xronos.acl (a fresh broker set up with systemd/mosquitto/mosquitto.conf);
# for an existing broker pass its own password_file and acl_file.
# Restart (or reload) Mosquitto afterwards: sudo systemctl restart mosquitto
set -euo pipefail

PASSWD=/etc/mosquitto/xronos.passwd ACL=/etc/mosquitto/xronos.acl BASE=xronos
ROLE="" NAME="" SET_PASSWORD=1 REMOVE=0

die() { echo "add-user.sh: error: $*" >&2; exit 2; }
say() { echo "add-user.sh: $*"; }

args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --passwd) PASSWD="${2:-}"; shift 2 ;;
        --acl) ACL="${2:-}"; shift 2 ;;
        --base) BASE="${2:-}"; shift 2 ;;
        --no-password) SET_PASSWORD=0; shift ;;
        --remove) REMOVE=1; shift ;;
        -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) die "unknown option '$1' (see --help)" ;;
        *) args+=("$1"); shift ;;
    esac
done
if [ "$REMOVE" = 1 ]; then
    [ "${#args[@]}" = 1 ] || die "--remove takes exactly one NAME"
    NAME="${args[0]}"
else
    [ "${#args[@]}" = 2 ] || die "expected ROLE NAME (see --help)"
    ROLE="${args[0]}" NAME="${args[1]}"
    case "$ROLE" in gateway|node|homeassistant|cli|keep) ;;
        *) die "ROLE must be gateway, node, homeassistant, cli or keep, got '$ROLE'" ;; esac
fi
# A user name becomes an ACL topic level: no wildcards, separators or spaces.
printf '%s' "$NAME" | grep -Eq '^[A-Za-z0-9_.-]{1,64}$' \
    || die "NAME '$NAME': use letters, digits, '_', '.', '-' (at most 64); a node's NAME is its node_id"
printf '%s' "$BASE" | grep -Eq '^[A-Za-z0-9_./-]+$' || die "--base '$BASE' is not a usable topic prefix"
case "$BASE" in /*|*/|*//*) die "--base '$BASE': no leading, trailing or empty levels" ;; esac

# A node's own topics (protocol/topics.py), by direction: node → others, and others → node.
# availability and capabilities are in both: the node answers an `offline` left by another process
# under its name, and reports another process announcing itself under it (a duplicate node id).
NODE_WRITES="availability capabilities profile/report ack metrics error inspect/report job catalog state"
NODE_READS="availability capabilities profile/request assignment control inspect/request catalog/request set"

block() {
    case "$ROLE" in
        gateway) printf 'topic readwrite %s/#\ntopic write homeassistant/device/#\ntopic read homeassistant/status\n' "$BASE" ;;
        node)  # writes its reports, reads its commands: its credentials cannot command it
            for leaf in $NODE_WRITES; do printf 'topic write %s/node/%s/%s\n' "$BASE" "$NAME" "$leaf"; done
            for leaf in $NODE_READS; do printf 'topic read %s/node/%s/%s\n' "$BASE" "$NAME" "$leaf"; done
            printf 'topic read %s/gateway/availability\n' "$BASE" ;;
        homeassistant) printf 'topic read %s/#\ntopic write %s/gateway/set\ntopic write %s/node/+/set\ntopic readwrite homeassistant/#\n' "$BASE" "$BASE" "$BASE" ;;
        cli) printf 'topic read %s/#\ntopic write %s/gateway/request/#\n' "$BASE" "$BASE" ;;
        keep) printf 'topic readwrite #\ntopic read $SYS/#\n' ;;
    esac
}

owned_file() {  # create FILE readable by the broker only, if it does not exist yet
    [ -e "$1" ] && return 0
    install -d -m 0755 "$(dirname "$1")"
    install -m 0640 /dev/null "$1"
    if getent group mosquitto >/dev/null; then chown root:mosquitto "$1"; fi
}

strip_block() {  # the ACL file without NAME's block (between its markers)
    awk -v begin="# xronos-user $NAME begin" -v end="# xronos-user $NAME end" '
        $0 == begin { skip = 1; next }
        $0 == end { skip = 0; next }
        !skip { print }' "$ACL"
}

owned_file "$ACL"
tmp="$(mktemp "$ACL.XXXXXX")"
trap 'rm -f "$tmp"' EXIT
strip_block >"$tmp"
if [ "$REMOVE" = 0 ]; then
    {
        [ -s "$tmp" ] && [ -n "$(tail -c 1 "$tmp")" ] && echo
        printf '# xronos-user %s begin\nuser %s\n' "$NAME" "$NAME"
        block
        printf '# xronos-user %s end\n' "$NAME"
    } >>"$tmp"
fi
chmod --reference="$ACL" "$tmp"
chown --reference="$ACL" "$tmp"
mv -f "$tmp" "$ACL"
trap - EXIT

if [ "$REMOVE" = 1 ]; then
    if [ -e "$PASSWD" ] && grep -q "^$NAME:" "$PASSWD"; then mosquitto_passwd -D "$PASSWD" "$NAME"; fi
    say "removed user $NAME from $ACL and $PASSWD"
    exit 0
fi
if [ "$ROLE" != keep ] && [ "$SET_PASSWORD" = 1 ]; then
    command -v mosquitto_passwd >/dev/null || die "mosquitto_passwd not found (apt install mosquitto)"
    owned_file "$PASSWD"
    mosquitto_passwd "$PASSWD" "$NAME"
fi
say "$ROLE user $NAME: ACL block in $ACL${SET_PASSWORD:+}$([ "$ROLE" != keep ] && [ "$SET_PASSWORD" = 1 ] && echo ", password in $PASSWD")"
