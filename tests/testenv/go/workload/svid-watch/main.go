// Command svid-watch is the test bed's workload: it streams its X.509-SVIDs from the SPIFFE
// Workload API, fetches a JWT-SVID for an audience whenever they change, and appends what it
// holds to a JSON-lines report that the tests read:
//
//	{"kind":"svids","at_ms":…,"svids":[{"spiffe_id":"spiffe://…","dns_names":[…],"not_after_ms":…,"serial":"…"}]}
//	{"kind":"jwt","at_ms":…,"spiffe_id":"spiffe://…","audience":["…"],"expiry_ms":…}
//	{"kind":"second","at_ms":…,"spiffe_ids":["spiffe://…"]}   once a second: the valid SVIDs held
//	{"kind":"error","at_ms":…,"error":"…"}                     the stream failed (it retries)
//
// SVIDs are held from their arrival until they expire, are replaced, or the agent says this
// workload has no identity (PermissionDenied); a stream broken for any other reason (the
// agent restarting) leaves the SVIDs it delivered valid, as it does for any real workload.
package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"log"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/svid/jwtsvid"
	"github.com/spiffe/go-spiffe/v2/workloadapi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

type report struct {
	mu   sync.Mutex
	file *os.File
}

func (r *report) write(line map[string]any) {
	line["at_ms"] = time.Now().UnixMilli()
	data, err := json.Marshal(line)
	if err != nil {
		log.Fatalf("encoding a report line: %v", err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, err := r.file.Write(append(data, '\n')); err != nil {
		log.Fatalf("writing the report: %v", err)
	}
}

// held is the X.509-SVIDs the workload holds now, by SPIFFE ID, with their expiry.
type held struct {
	mu   sync.Mutex
	svid map[string]time.Time
}

func (h *held) set(svids map[string]time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.svid = svids
}

// valid lists the SPIFFE IDs of the SVIDs held and not expired at now, sorted.
func (h *held) valid(now time.Time) []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	ids := []string{}
	for id, notAfter := range h.svid {
		if now.Before(notAfter) {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	return ids
}

type watcher struct {
	ctx      context.Context
	client   *workloadapi.Client
	audience string
	report   *report
	held     *held
}

func (w *watcher) OnX509ContextUpdate(update *workloadapi.X509Context) {
	held := map[string]time.Time{}
	svids := []map[string]any{}
	for _, svid := range update.SVIDs {
		leaf := svid.Certificates[0]
		held[svid.ID.String()] = leaf.NotAfter
		svids = append(svids, map[string]any{
			"spiffe_id":    svid.ID.String(),
			"dns_names":    leaf.DNSNames,
			"not_after_ms": leaf.NotAfter.UnixMilli(),
			"serial":       hex.EncodeToString(leaf.SerialNumber.Bytes()),
		})
	}
	w.held.set(held)
	w.report.write(map[string]any{"kind": "svids", "svids": svids})
	if w.audience == "" || len(svids) == 0 {
		return
	}
	jwt, err := w.client.FetchJWTSVID(w.ctx, jwtsvid.Params{Audience: w.audience})
	if err != nil {
		w.report.write(map[string]any{"kind": "error", "error": "jwt: " + err.Error()})
		return
	}
	w.report.write(map[string]any{
		"kind":      "jwt",
		"spiffe_id": jwt.ID.String(),
		"audience":  jwt.Audience,
		"expiry_ms": jwt.Expiry.UnixMilli(),
	})
}

func (w *watcher) OnX509ContextWatchError(err error) {
	if status.Code(errors.Unwrap(err)) == codes.PermissionDenied || status.Code(err) == codes.PermissionDenied {
		w.held.set(nil)
	}
	w.report.write(map[string]any{"kind": "error", "error": err.Error()})
}

func main() {
	socket := flag.String("socket", "unix:///run/spire/agent-sockets/agent.sock", "Workload API address")
	out := flag.String("report", "", "JSON-lines report file (default /report/$POD_NAME.jsonl)")
	audience := flag.String("audience", "registrar-bed", "audience of the JWT-SVID fetched after each X.509-SVID")
	flag.Parse()
	path := *out
	if path == "" {
		path = "/report/" + os.Getenv("POD_NAME") + ".jsonl"
	}
	file, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		log.Fatalf("opening the report: %v", err)
	}
	rep := &report{file: file}
	ctx := context.Background()
	client, err := workloadapi.New(ctx, workloadapi.WithAddr(*socket))
	if err != nil {
		log.Fatalf("Workload API client: %v", err)
	}
	h := &held{}
	go func() {
		for range time.Tick(time.Second) {
			rep.write(map[string]any{"kind": "second", "spiffe_ids": h.valid(time.Now())})
		}
	}()
	w := &watcher{ctx: ctx, client: client, audience: *audience, report: rep, held: h}
	err = client.WatchX509Context(ctx, w)
	log.Fatalf("the X.509 watch ended: %v", err)
}
