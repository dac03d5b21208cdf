"""Attacks for benchmarks/faults/faults.py: hostile MQTT clients against the live namespace star.

The real `mosquitto_pub` / `mosquitto_sub` run from dev2's namespace, with no certificate (an
outsider), with dev2's (a compromised device: it may join sessions of its own and sign with
their keys) or with a SUN worker's (a compromised prefill worker), while dev1 and dev2 generate
and the app sends SUN requests (benchmarks/lib/hostile_star.py has the kit). Each row says what
the star did; forged accepted counts what got through: a forged message the receiving service
did not count as dropped (its telemetry's dropped count), one that had an effect (an answer, a
routing, a token) or one the broker should have refused that a hub-role observer saw passing.
tests/system/test_hostile_clients.py proves the drop reasons in-process; this measures the
same attacks on the deployed star, over TLS with the hub's ACL. Telemetry carries a service's
dropped total only, so a reason in brackets is the one that test proves, not one read here;
the SUN router exports no counters at all (the hub's telemetry leaves them out), so what it
refuses is judged by its effects on the wire (a routing, a token, its error answer).

    sudo .venv/bin/python -m benchmarks.faults.faults --only hostile
"""
from __future__ import annotations

import secrets
import threading
import time

import msgpack

from benchmarks.lib.fault_bench import SUN_PROMPTS, Fault
from benchmarks.lib.hostile_star import Hostile, Load, PeakRss, answers, body, new_rid, reheader, tag
from edge.model import kv_blob
from edge.wire import protocol as P
from harness.mosquitto_clients import signed

N = 50                         # copies of each forged message (a flood sends FLOOD)
FLOOD = 2000                   # small forged messages in the flood, on each of two targets
BIG = 40                       # and messages just under the 4 MiB limit: 160 MiB
WRONG_KEY = secrets.token_bytes(32)


def _row(attack, spares: bool = False, sun: bool = True):
    """attack(h, b) -> (what happened, forged accepted, extra), with the legit load meanwhile."""
    def run(b):
        if spares:
            b.star.start_spares()
        h = Hostile(b.star)
        load = Load(b, sun)
        try:
            happened, forged, extra = attack(h, b)
        except BaseException:
            load.stop("aborted")
            raise
        finally:
            h.close()
        out = load.stop(happened, forged_accepted=forged, extra=extra)
        if spares:
            b.star.stop_spares()
        return out
    return run


def _err(r) -> str:
    return (r.stderr or r.stdout or "").strip().splitlines()[-1][:60] if (r.stderr or r.stdout) else "no output"


def _unconfirmed(sent: int, counted: int) -> int:
    """Forged messages the service did not count as dropped: not known to be refused."""
    return max(0, sent - counted)


def _dev1_message(h, b):
    """(topic, bytes) of a genuine draft request of dev1's, captured by the hub-role observer
    (what dev2 cannot read: the attacker is handed dev1's session id and a message of it)."""
    with h.observer().capture("ss/s/dev1/+/+/up", count=1) as cap:
        b.generate(("t1",), n=1)
        got = cap.get()
    return got[0]


def outsider(h, b):
    join = P.encode(P.Join("dev1", h.model_fp, h.vocab, nonce="outsider"))
    req = P.encode(P.SunRequest("app", new_rid(), "maths", [5, 17], max_new=4))
    with h.observer().capture(P.join_topic("dev1"), P.sun_req_topic("app")) as seen:
        r1 = h.as_(None).pub(P.join_topic("dev1"), join, check=False)
        r2 = h.plain().pub(P.sun_req_topic("app"), req, check=False, timeout=30)
        sub = h.as_(None).capture("ss/#", wait_s=3)
        got = sub.get()
        time.sleep(0.5)
    copies = sum(p in (join, req) for _, p in seen.messages)
    return (f"no client certificate (only the CA): mosquitto_pub of a join as dev1 exits {r1.returncode} "
            f"({_err(r1)}), mosquitto_sub ss/# gets {len(got)} messages (exit {sub.proc.returncode}); plain "
            f"MQTT to the TLS port, a SUN request as the app: exit {r2.returncode} ({_err(r2)}); the hub-role "
            f"observer saw {copies} of them"), copies + len(got), {}


def eavesdrop(h, b):
    from server.acl import Acl
    acl = Acl()
    acl.add("dev2")
    topics = ["ss/#", "ss/s/dev1/#", "ss/c/dev1/joined", "ss/sun/r/app/#", "ss/sun/w/#", "ss/dev/#", "$SYS/#"]
    with h.observer().capture("ss/s/dev1/#", "ss/sun/r/app/#") as seen, h.as_("dev2").capture(*topics) as cap:
        b.generate(("t1",), n=2)
        b.sun[0].generate("maths", SUN_PROMPTS[0], max_new=8)
        time.sleep(1)
    leaked = [t for t, _ in cap.messages if not acl.allows("dev2", t, "read")]
    own = sorted({"/".join(t.split("/")[:3]) for t, _ in cap.messages if acl.allows("dev2", t, "read")})
    return (f"dev2's certificate subscribes to {' '.join(topics)} while dev1 and the app are served "
            f"({len(seen.messages)} messages of theirs passed, as the hub-role observer saw): it got "
            f"{len(cap.messages)} messages, on its own topics ({', '.join(own) or 'none'}), "
            f"{len(leaked)} of others'"), len(leaked), {"leaked_topics": sorted(set(leaked))[:20]}


def forged_hmac(h, b):
    dev2 = h.as_("dev2")
    j = h.join(dev2, "dev2")
    forged = P.encode(P.DraftRequest(j.sid, 100, 0, [5, 6], 3), WRONG_KEY)
    into_dev1 = P.encode(P.DraftRequest(j.sid, 101, 0, [5, 6], 3), WRONG_KEY)
    with dev2.capture(j.down) as mine, h.observer().capture("ss/s/dev1/+/+/up") as seen:
        before = h.dropped("draft1")
        dev2.pub(j.up, forged, repeat=N)
        # the ACL: dev2 writes only ss/s/dev2/... (the broker drops them; with --repeat it may drop the client)
        cut = dev2.pub(P.up_topic("dev1", j.sid, j.draft), into_dev1, repeat=N, check=False).returncode
        counted = h.counted("draft1", before, N)
        dev2.pub(j.up, h.request(j, 1))                  # the session still works for its holder
        ok = mine.wait_for(lambda t, p: body(p).get("seq") == 1, 15)
    h.bye(dev2, j)
    answered = [a for a in answers(mine, j.secret) if getattr(a, "seq", 0) in (100, 101)]
    copies = sum(p == into_dev1 for _, p in seen.messages)
    return (f"dev2 joined a session of its own (mosquitto_pub/_sub) and sent {N} draft requests signed with a "
            f"wrong key on it: the draft service counted {counted} dropped (auth) and answered "
            f"{len(answered)}; {N} more on dev1's session topics: the broker refused them (mosquitto_pub "
            f"exit {cut}; the hub-role observer saw {copies} pass); the session's genuine request was "
            f"{'answered' if ok else 'NOT answered'}"
            ), max(len(answered), _unconfirmed(N, counted)) + copies, {"counted_dropped": counted}


def replay(h, b):
    dev2 = h.as_("dev2")
    j = h.join(dev2, "dev2")
    genuine = h.request(j, 1)
    with dev2.capture(j.down) as mine:
        dev2.pub(j.up, genuine)
        mine.wait_for(lambda t, p: body(p).get("seq") == 1, 15)
        before = h.dropped("draft1")
        dev2.pub(j.up, genuine, repeat=N)
        counted = h.counted("draft1", before, N)
    h.bye(dev2, j)
    answered = [a for a in answers(mine, j.secret) if getattr(a, "seq", 0) == 1]
    # dev1's own message, replayed with dev1's (stolen) certificate into its session while it lives
    with h.observer().capture("ss/s/dev1/+/+/up", "ss/s/dev1/+/+/down") as seen:
        gen = threading.Thread(target=lambda: b.star.complete("t1", "the the he", 300))
        gen.start()
        got = seen.wait_for(lambda t, p: t.endswith("/up") and tag(p) == "draft_req", 30)
        before1 = h.dropped("draft1")
        h.as_("dev1").pub(got[0], got[1], repeat=N)
        gen.join()
        counted1 = h.counted("draft1", before1, N)
    sid, seq = got[0].split("/")[3], body(got[1]).get("seq")
    again = [p for t, p in seen.messages if t.endswith("/down") and t.split("/")[3] == sid
             and body(p).get("seq") == seq]
    return (f"dev2 replayed its session's answered request {N} times: the draft service counted {counted} dropped "
            f"(replay), answered it {len(answered)} time(s) in all; a draft request of dev1's captured on the "
            f"broker (seq {seq}) replayed {N} times with dev1's own stolen certificate (not its session key) "
            f"while dev1 generates: {counted1} counted dropped (replay, or unknown_session once that "
            f"generation ended), answered {len(again)} time(s) in all"), (
        max(len(answered) - 1, _unconfirmed(N, counted)) + max(len(again) - 1, _unconfirmed(N, counted1))), {}


def other_topics(h, b):
    dev2 = h.as_("dev2")
    topic, msg = _dev1_message(h, b)
    sid, draft = topic.split("/")[3:5]
    rid_app, rid_claim = new_rid(), new_rid()
    refused = {                                          # what the broker's ACL must refuse
        P.up_topic("dev1", sid, draft): P.encode(P.DraftRequest(sid, 900, 0, [5], 3), WRONG_KEY),
        P.join_topic("dev1"): P.encode(P.Join("dev1", h.model_fp, h.vocab, nonce="dev2-as-dev1")),
        P.sun_req_topic("app"): P.encode(P.SunRequest("app", rid_app, "maths", [5, 17], max_new=4)),
    }
    claim = P.encode(P.SunRequest("app", rid_claim, "maths", [5, 17], max_new=4))
    with h.observer().capture("ss/s/dev1/#", "ss/hub/join/dev1", "ss/sun/#") as seen:
        before = h.dropped("draft1")
        cut = [dev2.pub(t, p, check=False).returncode for t, p in refused.items()]
        dev2.pub(P.up_topic("dev2", sid, draft), msg, repeat=N)   # dev1's message under dev2's name
        dev2.pub(P.sun_req_topic("dev2"), claim)         # a request for the app on dev2's own topic
        counted = h.counted("draft1", before, N)
        time.sleep(1)
    passed = sum(p in refused.values() for _, p in seen.messages)
    effects = [t for t, p in seen.messages if p != claim and p not in refused.values()
               and any(r.encode() in p or r in t for r in (rid_app, rid_claim))]
    return (f"dev2 wrote to dev1's session topic, dev1's join topic and the app's SUN request topic: the broker "
            f"refused all (mosquitto_pub exits {cut}; the hub-role observer saw {passed} pass); dev1's captured "
            f"message under dev2's "
            f"name ({N} copies): the draft service counted {counted} dropped (topic: not dev2's session, or "
            f"unknown_session once it ended); a SUN request for the app on dev2's own topic: "
            f"{len(effects)} routing or token messages followed (the router drops it: bad_request)"), (
        passed + len(effects) + _unconfirmed(N, counted)), {}


def oversized(h, b):
    dev2 = h.as_("dev2")
    j = h.join(dev2, "dev2")
    big = b"\x00" * (P.MAX_MESSAGE_BYTES + 1)
    with dev2.capture(j.down) as mine, h.observer().capture("ss/sun/w/+/ctl") as seen:
        before = h.dropped("draft1")
        dev2.pub(j.up, big, repeat=3)
        dev2.pub(P.sun_req_topic("dev2"), big, repeat=3)
        counted = h.counted("draft1", before, 3)
        time.sleep(1)
    h.bye(dev2, j)
    jobs = [p for _, p in seen.messages if tag(p) == "sun_prefill" and body(p).get("client") == "dev2"]
    return (f"3 payloads of {P.MAX_MESSAGE_BYTES + 1} bytes (the limit + 1) on dev2's session up topic: the draft "
            f"service counted {counted} dropped (size), answered {len(answers(mine, j.secret))}; 3 on its SUN "
            f"request topic: {len(jobs)} prefill jobs followed (the router drops them: bad_request_size)"), (
        len(answers(mine, j.secret)) + len(jobs) + _unconfirmed(3, counted)), {}


def out_of_range(h, b):
    from edge.star.draft_limits import DraftLimits
    dev2 = h.as_("dev2")
    j = h.join(dev2, "dev2")
    base = {"sid": j.sid, "keep": 0, "append": [1, 2], "sampling": P.sampling()}
    dropped = {50: {"gamma": P.MAX_GAMMA + 1}, 51: {"gamma": 2, "append": [h.vocab]},
               52: {"gamma": 2, "append": [P.MAX_VOCAB]}}
    refused = {53: {"gamma": DraftLimits().max_gamma + 1}}        # valid on the wire: answered with an error
    rid_vocab, rid_new = new_rid(), new_rid()
    sun_vocab = P.SunRequest("dev2", rid_vocab, "maths", [h.vocab + 10], max_new=4)
    sun_new = msgpack.unpackb(msgpack.unpackb(P.encode(P.SunRequest("dev2", rid_new, "maths", [5])))["b"])
    sun_new = msgpack.packb({"v": P.PROTOCOL_VERSION, "t": "sun_req", "s": "", "h": b"",
                             "b": msgpack.packb({**sun_new, "max_new": P.MAX_NEW_TOKENS + 1})})
    with dev2.capture(j.down) as mine, dev2.capture("ss/sun/r/dev2/+") as streams:
        before = h.dropped("draft1")
        for seq, kw in {**dropped, **refused}.items():
            dev2.pub(j.up, signed("draft_req", j.sid, {**base, "seq": seq, **kw}, j.secret))
        dev2.pub(P.sun_req_topic("dev2"), P.encode(sun_vocab))
        dev2.pub(P.sun_req_topic("dev2"), sun_new)
        counted = h.counted("draft1", before, len(dropped))
        mine.wait_for(lambda t, p: body(p).get("seq") == 53, 10)
        streams.wait_for(lambda t, p: rid_vocab in t, 10)
        time.sleep(0.5)
    h.bye(dev2, j)
    got = answers(mine, j.secret)
    drafted = [a for a in got if isinstance(a, P.DraftResponse) and a.seq >= 50]
    errors = [a.code for a in got if isinstance(a, P.Error) and a.seq in refused]
    sun_err = [a.code for a in answers(streams, sun_vocab.secret) if isinstance(a, P.Error)]
    sun_tok = [t for t, p in streams.messages if tag(p) == "sun_tokens"]
    return (f"with its own session's key dev2 sent γ {P.MAX_GAMMA + 1} (past the wire's limit) and token ids "
            f"{h.vocab} (the vocabulary) and {P.MAX_VOCAB} (the wire's limit): the draft service counted {counted} "
            f"dropped (invalid); γ {DraftLimits().max_gamma + 1} (past the service's limit) was answered "
            f"{errors or 'with nothing'}; drafted for none of them ({len(drafted)}); SUN requests with token id "
            f"{h.vocab + 10} (answered {sun_err or 'with nothing'}) and max_new {P.MAX_NEW_TOKENS + 1} (dropped "
            f"silently: bad_request_invalid): {len(sun_tok)} tokens streamed"), (
        len(drafted) + len(sun_tok) + _unconfirmed(len(dropped), counted)), {}


def bad_kv(h, b):
    pre1 = h.as_("pre1")                                 # a compromised prefill worker's certificate
    with h.observer().capture("ss/sun/w/+/kv/+", count=1) as cap:
        b.sun[0].generate("maths", SUN_PROMPTS[0], max_new=4)
        (_, chunk), = cap.get()
    kb = body(chunk)
    if kb.get("total") != 1:
        return f"not run: the captured KV blob spans {kb.get('total')} chunks (a bigger model)", None, {}
    head = kv_blob.read_header(kb["data"])
    other_fp = head["fingerprint"][:-1] + ("0" if head["fingerprint"][-1] != "0" else "1")
    wrong = "float32" if head["dtype"] == "float16" else "float16"     # another item size over the same bytes
    lies = {f"{wrong} header over {head['dtype']} bytes": reheader(kb["data"], dtype=wrong),
            "dtype int8": reheader(kb["data"], dtype="int8"),
            "two more layers (shape)": reheader(kb["data"], layers=head["layers"] + 2),
            "another decoder's fingerprint": reheader(kb["data"], fingerprint=other_fp)}
    seen, decoded, unrefused = [], 0, 0
    for what, blob in lies.items():
        rid, secret = new_rid(), P.new_secret()
        pre1.pub(P.sun_kv_topic("dec1", "pre1"), P.encode(P.KVChunk(rid, 0, 1, kb["first_token"], blob), secret))
        with pre1.capture(P.sun_stream_topic("pre1", rid)) as stream:   # before its assignment: held for it
            pre1.pub(P.sun_req_topic("pre1"), P.encode(P.SunRequest("pre1", rid, "maths", SUN_PROMPTS[0],
                                                                    max_new=8, secret=secret)))
            stream.wait_for(lambda t, p: tag(p) == "error", 20)
            time.sleep(0.3)
        got = answers(stream, secret)
        decoded += sum(len(m.tokens) for m in got if isinstance(m, P.SunTokens) and m.index >= 1)
        err = [f"{m.code}: {m.message.rsplit('refused: ', 1)[-1][:70]}" for m in got if isinstance(m, P.Error)]
        seen.append(f"{what} -> {err[0] if err else 'NOT refused'}")
        unrefused += not err
    return (f"pre1's certificate sent dec1 KV blobs that lie, each for a request of its own (held, then claimed "
            f"by the assignment): {'; '.join(seen)}; {decoded} tokens decoded for them"), unrefused, {}


def moved_kv(h, b):
    with h.observer().capture("ss/sun/w/+/kv/+") as cap:       # this request's: others are in flight
        rid = b.sun[0].generate("maths", SUN_PROMPTS[1], max_new=4).rid
        topic, chunk = cap.wait_for(lambda t, p: body(p).get("rid") == rid, 20)
    dec, sender = topic.split("/")[3], topic.split("/")[5]
    other = "dec2" if dec == "dec1" else "dec1"
    with h.observer().capture(f"ss/sun/r/+/{rid}") as after:
        before = {d: h.dropped(d) for d in (dec, other)}
        h.as_(sender).pub(P.sun_kv_topic(other, sender), chunk)    # meant for `dec`
        h.as_(sender).pub(P.sun_kv_topic(dec, sender), chunk)      # and again to its own, request done
        own = h.counted(dec, before[dec], 1)
        moved = h.counted(other, before[other], 1, timeout=45)     # held as early KV, dropped at 30 s
    return (f"a genuine KV chunk {sender} sent {dec}, captured on the broker, sent again with {sender}'s "
            f"certificate to {other}: held as early KV, then counted dropped {moved} (kv_unclaimed, at the "
            f"decoder's 30 s KV timeout); and to {dec} after its request ended: counted dropped {own} (auth); "
            f"{len(after.messages)} tokens followed"), len(after.messages) + _unconfirmed(1, own) + _unconfirmed(
        1, moved), {}


def flood(h, b):
    dev2 = h.as_("dev2")
    j = h.join(dev2, "dev2")
    small = P.encode(P.DraftRequest(j.sid, 7, 0, list(range(200)), 4), WRONG_KEY)
    big = signed("draft_req", j.sid, {"junk": b"j" * (P.MAX_MESSAGE_BYTES - 1024)}, WRONG_KEY)
    rid = new_rid()
    req = P.encode(P.SunRequest("dev2", rid, "maths", SUN_PROMPTS[0], max_new=4))
    with PeakRss(b.star) as mem, dev2.capture(j.down) as mine, h.observer().capture(
            f"ss/sun/r/dev2/{rid}", "ss/sun/w/+/ctl") as seen:
        before = h.dropped("draft1")
        jobs = [(j.up, small, FLOOD), (j.up, big, BIG), (P.sun_req_topic("dev2"), req, FLOOD)]
        ts = [threading.Thread(target=dev2.pub, args=job, kwargs={"timeout": 300}) for job in jobs]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        counted = h.counted("draft1", before, FLOOD + BIG, timeout=90)
        time.sleep(1)
    h.bye(dev2, j)
    answered = len(answers(mine, j.secret))
    routed = [p for _, p in seen.messages if tag(p) == "sun_prefill" and body(p).get("rid") == rid]
    grown = mem.grown()
    worst = max(grown, key=grown.get)
    mib = (FLOOD * len(small) + BIG * len(big) + FLOOD * len(req)) / 2 ** 20
    return (f"dev2 flooded {mib:.0f} MiB: {FLOOD} small and {BIG} ~4 MiB draft requests signed with a wrong key "
            f"on its session, and {FLOOD} copies of one SUN request: the draft service counted {counted} "
            f"dropped (auth), answered {answered}; the router prefilled the request {len(routed)} time(s) (the "
            f"other copies: replays); VmRSS grew at most {grown[worst]:.0f} MiB ({worst}) during the flood"), (
        answered + max(0, len(routed) - 1) + _unconfirmed(FLOOD + BIG, counted)), {"rss_growth_mb": grown}


FAULTS = [
    Fault("hostile: outsider without a client certificate", "attack", _row(outsider)),
    Fault("hostile: dev2 subscribes to ss/# and other sessions", "attack", _row(eavesdrop), needs_sun=True),
    Fault("hostile: forged HMAC on a session message", "attack", _row(forged_hmac)),
    Fault("hostile: replayed (old seq) session messages", "attack", _row(replay)),
    Fault("hostile: dev2 writes into dev1's and the app's topics", "attack", _row(other_topics), needs_sun=True),
    Fault("hostile: oversized payloads", "attack", _row(oversized)),
    Fault("hostile: γ and token ids out of range (a session's own key)", "attack", _row(out_of_range),
          needs_sun=True),
    Fault("hostile: KV blobs with wrong dtype, shape or decoder", "attack", _row(bad_kv), needs_sun=True),
    Fault("hostile: KV chunk moved to another decoder", "attack", _row(moved_kv, spares=True), needs_sun=True),
    Fault(f"hostile: flood of {2 * FLOOD + BIG} forged messages", "attack", _row(flood)),
]
