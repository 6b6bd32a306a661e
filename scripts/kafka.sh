#!/usr/bin/env bash
# Single-node Kafka (KRaft, broker+controller in one JVM) for local runs and CI.
#   scripts/kafka.sh install|start|stop|status|reset
# start prints the bootstrap address on stdout; everything else goes to stderr.
#
# KAFKA_SECURE=1 runs a second, secured broker beside the plaintext one: its own data, config
# and ports under $KAFKA_HOME/secure (the jars are shared), so it never disturbs the plaintext
# broker. See scripts/kafka-secure.sh for its listeners, certificates, users and ACLs.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KAFKA_HOME="${KAFKA_HOME:-$ROOT/.kafka}"
KAFKA_SECURE="${KAFKA_SECURE:-0}"
# Empty: the version pinned in kafka-pom.xml. A data dir formatted by a newer version
# cannot be opened by an older one: use another KAFKA_HOME (or reset) when going down.
KAFKA_VERSION="${KAFKA_VERSION:-}"
KAFKA_PORT="${KAFKA_PORT:-19092}"
KAFKA_CONTROLLER_PORT="${KAFKA_CONTROLLER_PORT:-19093}"
KAFKA_START_TIMEOUT="${KAFKA_START_TIMEOUT:-90}"
KAFKA_STOP_TIMEOUT="${KAFKA_STOP_TIMEOUT:-30}"
KAFKA_HEAP_OPTS="${KAFKA_HEAP_OPTS:--Xms128m -Xmx512m}"
# C1 only: the JVM starts noticeably faster on small CI boxes; a test broker never gets hot.
KAFKA_JVM_OPTS="${KAFKA_JVM_OPTS:--XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:TieredStopAtLevel=1 -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true}"
POM="$ROOT/scripts/kafka-pom.xml"
LIBS="$KAFKA_HOME/libs"
LOCKFILE="$KAFKA_HOME/.lock"
if [[ "$KAFKA_SECURE" == 1 ]]; then
    KAFKA_HOME="$KAFKA_HOME/secure"
    # shellcheck source=scripts/kafka-secure.sh
    source "$ROOT/scripts/kafka-secure.sh"
fi
DATA="$KAFKA_HOME/data"
CONF="$KAFKA_HOME/config"
PIDFILE="$KAFKA_HOME/kafka.pid"
LOG="$KAFKA_HOME/kafka.log"
ADDR="127.0.0.1:$KAFKA_PORT"
# Any valid id will do; a fixed one saves a JVM run of "StorageTool random-uuid".
CLUSTER_ID="MkU3OEVBNTcwNTJENDM2Qk"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python3

say() { echo "kafka.sh: $*" >&2; }

install() {
    # Installed = libs fetched for this exact pom + override; editing either reinstalls.
    local want
    want="$(cat "$POM"; echo "override=$KAFKA_VERSION")"
    if [[ -f "$LIBS/.installed" && "$(cat "$LIBS/.installed")" == "$want" ]]; then return; fi
    say "fetching Kafka ${KAFKA_VERSION:-(pom version)} jars into $LIBS"
    local tmp="$KAFKA_HOME/libs.tmp"
    rm -rf "$tmp"
    mvn -q -B -Dstyle.color=never -f "$POM" ${KAFKA_VERSION:+-Dkafka.version="$KAFKA_VERSION"} \
        dependency:copy-dependencies -DoutputDirectory="$tmp" >&2
    printf '%s\n' "$want" >"$tmp/.installed"
    rm -rf "$LIBS"
    mv "$tmp" "$LIBS"
}

pid() { [[ -f "$PIDFILE" ]] && cat "$PIDFILE"; }

running() {
    local p
    p="$(pid)" || return 1
    # Guard against a stale pid file whose pid now belongs to something else.
    grep -qa kafka.Kafka "/proc/$p/cmdline" 2>/dev/null || return 1
}

# The broker this script has just launched: alive and not a zombie. Until setsid has exec'd
# java, its cmdline is setsid's (or empty), so `running` would take a slow exec for an exit.
launched() {
    local p st
    p="$(pid)" || return 1
    read -r st 2>/dev/null <"/proc/$p/stat" || return 1
    st="${st##*) }"
    [[ "${st%% *}" != Z ]]
}

plain_listeners() {
    cat <<EOF
listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
auto.create.topics.enable=true
EOF
}

write_config() {
    mkdir -p "$CONF"
    {
        if [[ "$KAFKA_SECURE" == 1 ]]; then secure_listeners; else plain_listeners; fi
        cat <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$KAFKA_CONTROLLER_PORT
controller.listener.names=CONTROLLER
log.dirs=$DATA
num.partitions=3
default.replication.factor=1
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
# The defaults (50 partitions each) make the first group join / transactional init take
# several seconds on a 2-core box while the internal topics are created and loaded.
offsets.topic.num.partitions=1
transaction.state.log.num.partitions=1
group.initial.rebalance.delay.ms=0
# Faster registration/unfencing at startup and faster controlled shutdown. Before 4.x
# releases that accept re-registration after a clean shutdown, a restart is also refused
# with DUPLICATE_BROKER_REGISTRATION until the old session times out (default 9 s).
broker.heartbeat.interval.ms=500
broker.session.timeout.ms=3000
EOF
    } >"$CONF/server.properties"
    cat >"$CONF/log4j2.properties" <<'EOF'
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = out
logger.state.name = state.change.logger
logger.state.level = WARN
EOF
}

format() {
    say "formatting $DATA"
    rm -rf "$DATA"
    # kafka.tools.StorageTool is the Scala tool shipped in kafka_2.13 for all 4.x releases.
    local scram=()
    [[ "$KAFKA_SECURE" == 1 ]] && mapfile -t scram < <(scram_args)
    java -cp "$LIBS/*" -Dlog4j2.configurationFile="$CONF/log4j2.properties" \
        kafka.tools.StorageTool format -t "$CLUSTER_ID" -c "$CONF/server.properties" \
        "${scram[@]}" >>"$LOG" 2>&1
}

# "Accepting requests" = a real Metadata round trip that lists this broker, not just an open port.
probe() {
    timeout 15 "$PYTHON" - "$ADDR" <<'EOF' >/dev/null 2>&1
import asyncio, sys
from aiokafka.admin import AIOKafkaAdminClient

async def main():
    admin = AIOKafkaAdminClient(bootstrap_servers=sys.argv[1], request_timeout_ms=5000)
    await admin.start()
    try:
        assert (await admin.describe_cluster())["brokers"]
    finally:
        await admin.close()

asyncio.run(main())
EOF
}

fail() {
    say "$1; last lines of $LOG:"
    tail -n 40 "$LOG" >&2 || true
    exit 1
}

wait_ready() {
    local deadline=$((SECONDS + KAFKA_START_TIMEOUT))
    while ((SECONDS < deadline)); do
        launched || fail "broker exited during startup"
        # Cheap port check first so python is only started once something listens.
        if (exec 3<>"/dev/tcp/127.0.0.1/$KAFKA_PORT") 2>/dev/null && probe; then
            if [[ "$KAFKA_SECURE" == 1 ]]; then
                add_acls || fail "could not add the ACLs"
                echo "$SECURE_ADDR"
            else
                echo "$ADDR"
            fi
            return
        fi
        sleep 0.5
    done
    fail "broker not ready after ${KAFKA_START_TIMEOUT}s"
}

start() {
    if running; then wait_ready; return; fi
    install
    if [[ "$KAFKA_SECURE" == 1 ]]; then make_certs; fi
    # The config follows this run's ports (a home started before with others keeps its data).
    write_config
    [[ -f "$DATA/meta.properties" ]] || format
    say "starting broker on $ADDR (log: $LOG)"
    # setsid: the broker must outlive this script and not get the caller's Ctrl-C.
    # 9>&-: do not let the broker inherit (and hold forever) the lock taken in main.
    # shellcheck disable=SC2086
    setsid java $KAFKA_HEAP_OPTS $KAFKA_JVM_OPTS \
        -Dlog4j2.configurationFile="$CONF/log4j2.properties" \
        -cp "$LIBS/*" kafka.Kafka "$CONF/server.properties" \
        </dev/null >>"$LOG" 2>&1 9>&- &
    echo $! >"$PIDFILE"
    wait_ready
}

stop() {
    if ! running; then rm -f "$PIDFILE"; return; fi
    local p deadline=$((SECONDS + KAFKA_STOP_TIMEOUT))
    p="$(pid)"
    kill -TERM "$p"
    # running, not kill -0: an exited but unreaped broker is a zombie and still "exists".
    while running && ((SECONDS < deadline)); do sleep 0.2; done
    if running; then
        say "no exit after ${KAFKA_STOP_TIMEOUT}s, killing $p"
        kill -KILL "$p"
        while running; do sleep 0.1; done
    fi
    rm -f "$PIDFILE"
}

mkdir -p "$KAFKA_HOME"
# Serialise concurrent callers (parallel test workers, CI steps) on one broker; the secured
# broker takes the same lock, since it shares the jars.
exec 9>"$LOCKFILE"
flock -w 600 9

case "${1:-}" in
install) install ;;
start) start ;;
stop) stop ;;
status) running && echo "${SECURE_ADDR:-$ADDR}" ;;
reset) stop; rm -rf "$DATA" "$CONF" "${CERTS:-$DATA}" ;;
*) echo "usage: $0 install|start|stop|status|reset" >&2; exit 2 ;;
esac
