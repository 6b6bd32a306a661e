# Sourced by scripts/kafka.sh when KAFKA_SECURE=1: the secured single-node test broker.
#
#   SASL_SSL  127.0.0.1:19094  TLS + SASL (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512)
#   SSL       127.0.0.1:19095  TLS with required client certificates (mTLS); the principal is the
#                              certificate's CN (User:collector for CN=collector)
#   INTERNAL  127.0.0.1:19097  plaintext, loopback only, for the broker itself, the readiness probe
#                              and adding ACLs: its ANONYMOUS principal is a super user, so this
#                              listener is for a test broker only
#   CONTROLLER 127.0.0.1:19096
# The ports are the plaintext broker's KAFKA_PORT + 2, 3, 5 and 4 (19092 by default), so a second
# pair of brokers for another checkout (its own KAFKA_HOME and KAFKA_PORT) never takes this pair's.
#
# Certificates (made here with openssl at the first start, in $KAFKA_HOME/certs): a test CA, the
# broker's certificate for 127.0.0.1/localhost, client certificates CN=collector, CN=aggregator
# and CN=reader signed by it, and a second, untrusted CA with a CN=collector certificate of its
# own. Users (SCRAM added at format time, PLAIN in the listener's JAAS): admin (super user),
# collector, aggregator, reader and nobody, password "<name>-secret", one file per user in
# $KAFKA_HOME/secrets/<name>.password. ACLs (StandardAuthorizer, nothing allowed without one):
# see add_acls below.

PLAINTEXT_PORT="$KAFKA_PORT"
KAFKA_PORT="${KAFKA_SECURE_INTERNAL_PORT:-$((PLAINTEXT_PORT + 5))}"
KAFKA_CONTROLLER_PORT="${KAFKA_SECURE_CONTROLLER_PORT:-$((PLAINTEXT_PORT + 4))}"
SASL_SSL_PORT="${KAFKA_SECURE_SASL_PORT:-$((PLAINTEXT_PORT + 2))}"
MTLS_PORT="${KAFKA_SECURE_MTLS_PORT:-$((PLAINTEXT_PORT + 3))}"
CERTS="$KAFKA_HOME/certs"
SECRETS="$KAFKA_HOME/secrets"
USERS=(admin collector aggregator reader nobody)
SECURE_ADDR="sasl_ssl=127.0.0.1:$SASL_SSL_PORT
ssl=127.0.0.1:$MTLS_PORT
internal=127.0.0.1:$KAFKA_PORT
certs=$CERTS
secrets=$SECRETS"

ensure_openssl() {
    command -v openssl >/dev/null && return
    say "installing openssl"
    bash "$ROOT/scripts/install-debs.sh" >&2
}

# cert NAME CN CA [SAN]: a key (PKCS#8, unencrypted) and a certificate signed by CA.
cert() {
    local name="$1" cn="$2" ca="$3" san="${4:-}"
    openssl req -new -newkey rsa:2048 -nodes -subj "/CN=$cn" \
        -keyout "$CERTS/$name.key" -out "$CERTS/$name.csr" 2>/dev/null
    local ext="$CERTS/$name.ext"
    if [[ -n "$san" ]]; then
        printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$san" >"$ext"
    else
        printf 'extendedKeyUsage=clientAuth\n' >"$ext"
    fi
    openssl x509 -req -in "$CERTS/$name.csr" -CA "$CERTS/$ca.pem" -CAkey "$CERTS/$ca.key" \
        -CAcreateserial -days 3650 -sha256 -extfile "$ext" -out "$CERTS/$name.pem" 2>/dev/null
    rm -f "$CERTS/$name.csr" "$ext"
}

make_certs() {
    [[ -f "$CERTS/.done" ]] && return
    ensure_openssl
    say "making test certificates in $CERTS"
    rm -rf "$CERTS" "$SECRETS"
    mkdir -p "$CERTS" "$SECRETS"
    for ca in ca rogue-ca; do
        openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=hami-usage test $ca" \
            -keyout "$CERTS/$ca.key" -out "$CERTS/$ca.pem" 2>/dev/null
    done
    cert broker localhost ca "DNS:localhost,IP:127.0.0.1"
    for user in collector aggregator reader; do cert "$user" "$user" ca; done
    cert rogue collector rogue-ca
    # Kafka's PEM keystore: the key and its certificate in one file.
    cat "$CERTS/broker.key" "$CERTS/broker.pem" >"$CERTS/broker-keystore.pem"
    for user in "${USERS[@]}"; do printf '%s' "$user-secret" >"$SECRETS/$user.password"; done
    chmod 600 "$CERTS"/*.key "$SECRETS"/*
    touch "$CERTS/.done"
}

# The listeners and security half of server.properties (kafka.sh writes the rest).
secure_listeners() {
    local plain_users="" user
    for user in "${USERS[@]}"; do plain_users+=" user_$user=\"$user-secret\""; done
    cat <<EOF
listeners=SASL_SSL://127.0.0.1:$SASL_SSL_PORT,MTLS://127.0.0.1:$MTLS_PORT,INTERNAL://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT
advertised.listeners=SASL_SSL://127.0.0.1:$SASL_SSL_PORT,MTLS://127.0.0.1:$MTLS_PORT,INTERNAL://127.0.0.1:$KAFKA_PORT
inter.broker.listener.name=INTERNAL
listener.security.protocol.map=SASL_SSL:SASL_SSL,MTLS:SSL,INTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT
sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512
listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required$plain_users;
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
ssl.keystore.type=PEM
ssl.keystore.location=$CERTS/broker-keystore.pem
ssl.truststore.type=PEM
ssl.truststore.location=$CERTS/ca.pem
listener.name.mtls.ssl.client.auth=required
ssl.principal.mapping.rules=RULE:^CN=([^,]+)\$/\$1/,DEFAULT
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:admin;User:ANONYMOUS
allow.everyone.if.no.acl.found=false
auto.create.topics.enable=false
EOF
}

scram_args() {
    local user mech
    for user in "${USERS[@]}"; do
        for mech in SCRAM-SHA-256 SCRAM-SHA-512; do
            printf -- '--add-scram\n%s=[name=%s,password=%s-secret]\n' "$mech" "$user" "$user"
        done
    done
}

# The principals' rights, by prefix so that tests can use fresh topic and group names:
#   collector:  write and describe topics hami.usage*
#   aggregator: read hami.usage*, write hami.billing*, groups and transactional ids hami-usage*
#   reader:     read hami.billing*, groups billing-reader*
#   nobody:     nothing
add_acls() {
    "$PYTHON" "$ROOT/scripts/kafka_acls.py" "127.0.0.1:$KAFKA_PORT" >>"$LOG" 2>&1
}
