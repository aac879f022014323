#!/bin/sh
# The built-in Redis' entrypoint (rendered into its ConfigMap; docs/redis.md, "The built-in Redis").
#
# Writes the mounted password into the file redis.conf includes, starts redis-server, and follows
# the mounted Secret: every REDIS_ROTATE_S seconds it compares the file with the password in
# force and, when it changed (a rotated Secret, a `helm upgrade` that generated a new one), sets
# the new one with CONFIG SET requirepass, logged in with the old one, which keeps working until
# then. The kubelet updates a Secret volume's files in place (items with a path do; subPath would
# not), so no restart is needed. Passwords travel in files, stdin and REDISCLI_AUTH, never in a
# command line. SIGTERM and SIGINT go to redis-server; the script exits with its status.
#
# Every path comes from the environment so that a test can run this with a local redis-server;
# the defaults are the container's.
set -u

server=${REDIS_SERVER:-redis-server}
cli=${REDIS_CLI:-redis-cli}
conf=${REDIS_CONF:-/etc/redis/conf/redis.conf}
password_file=${REDIS_PASSWORD_FILE:-/etc/redis/auth/password}
auth_conf=${REDIS_AUTH_CONF:-/run/redis/auth.conf}
port=${REDIS_PORT:-6379}
rotate_s=${REDIS_ROTATE_S:-5}

log() { echo "redis-entrypoint: $*" >&2; }

# The password as Redis' config parser reads it back: quotes and backslashes escaped. Written to a
# new file and renamed, so that a restart never reads half of it.
write_auth_conf() {
    escaped=$(printf '%s' "$1" | sed 's/[\\"]/\\&/g')
    printf 'requirepass "%s"\n' "$escaped" > "$auth_conf.new" && mv -f "$auth_conf.new" "$auth_conf"
}

# A trailing newline in the Secret is not part of the password (as `$(...)` strips it).
read_password() { cat "$password_file" 2>/dev/null; }

umask 077
current=$(read_password)
if [ -z "$current" ]; then
    log "no password in $password_file: set the key named by redis.auth.key in the Secret"
    exit 1
fi
write_auth_conf "$current" || exit 1

"$server" "$conf" &
pid=$!
sleeper=

stop() {
    kill -TERM "$pid" 2>/dev/null
    [ -n "$sleeper" ] && kill "$sleeper" 2>/dev/null
    wait "$pid"
    exit $?
}
trap stop TERM INT

# Sets the new password; true once Redis asks for it (set now, or found already set).
rotate() {
    reply=$(printf '%s' "$1" | REDISCLI_AUTH="$current" "$cli" -h 127.0.0.1 -p "$port" --no-auth-warning \
        -x CONFIG SET requirepass 2>&1)
    [ "$reply" = OK ] && return 0
    [ "$(REDISCLI_AUTH="$1" "$cli" -h 127.0.0.1 -p "$port" --no-auth-warning PING 2>/dev/null)" = PONG ] && return 0
    log "the new password is not set yet (retrying in ${rotate_s}s): $(printf '%s' "$reply" | head -n 1)"
    return 1
}

while kill -0 "$pid" 2>/dev/null; do
    # sleep in the background: a signal interrupts `wait` at once, it would not interrupt `sleep`
    sleep "$rotate_s" &
    sleeper=$!
    wait "$sleeper"
    sleeper=
    new=$(read_password)
    if [ -z "$new" ]; then
        log "$password_file is empty or unreadable: keeping the password in force"
    elif [ "$new" != "$current" ] && rotate "$new"; then
        current=$new
        write_auth_conf "$current"
        log "password rotated"
    fi
done
wait "$pid"
exit $?
