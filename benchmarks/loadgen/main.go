// Closed-loop gRPC load generator of benchmarks/bench_workers.py: one cheap client process in place of
// several Python ones, so the servers, not the client, are what saturates.
//
// Build (a static linux/amd64 binary at benchmarks/loadgen/bin/loadgen, GOPATH mode against Debian's
// /usr/share/gocode, as tests/system/clients_support.py builds clients/go):
//
//	python -m benchmarks.loadgen
//
// Usage:
//
//	loadgen -address HOST:PORT -request-file PATH [-method /indexer.v1.PrefillMetadata/BuildChunk]
//	    [-in-flight 32] [-connections 4] [-seconds 2] [-start-at UNIX_EPOCH_SECONDS]
//
// The request file holds the serialized request; a codec that passes bytes through sends it as is and keeps the
// answers' bytes unparsed. Each of -connections is its own grpc.ClientConn (its own TCP connection, which the
// kernel's SO_REUSEPORT hands to one worker); each call goes to the connection with the fewest calls in flight,
// ties in turn (service.client.ChannelPool's rule). Every connection is warmed with one call, then the loop
// starts at -start-at (if given) and keeps -in-flight calls going for -seconds; calls in flight at the end
// finish and count. Retries off, 64 MiB answers accepted, 60 s deadline per call.
//
// Prints one JSON line: calls (all finished calls of the loop, warm-up calls excluded), elapsed (seconds, start
// to the last call's end), errors (non-OK calls by gRPC code name), p50_us and p99_us (OK calls, nearest rank;
// null without any), per_connection_calls. Exit 2: usage error; 1: a warm-up call or the request file failed.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"sort"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

// rawCodec sends a *[]byte as the message and stores the answer's bytes in one. Named "proto" so that gRPC
// versions that derive the content-subtype from the forced codec still send application/grpc+proto.
type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) { return *v.(*[]byte), nil }

func (rawCodec) Unmarshal(data []byte, v interface{}) error {
	*v.(*[]byte) = data
	return nil
}

func (rawCodec) Name() string { return "proto" }

// pool picks the connection with the fewest calls in flight, the ties in turn, and counts each one's calls.
type pool struct {
	mu       sync.Mutex
	inFlight []int
	calls    []int
	turn     int
}

func (p *pool) acquire() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := len(p.inFlight)
	best := p.turn % n
	for i := 1; i < n; i++ {
		if j := (p.turn + i) % n; p.inFlight[j] < p.inFlight[best] {
			best = j
		}
	}
	p.turn++
	p.inFlight[best]++
	return best
}

func (p *pool) release(i int) {
	p.mu.Lock()
	p.inFlight[i]--
	p.calls[i]++
	p.mu.Unlock()
}

func usage(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "loadgen: "+format+"\n", args...)
	flag.Usage()
	os.Exit(2)
}

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "loadgen: "+format+"\n", args...)
	os.Exit(1)
}

// percentileUs is the nearest-rank percentile of sorted durations, in microseconds; nil when there are none.
func percentileUs(sorted []time.Duration, q float64) *float64 {
	if len(sorted) == 0 {
		return nil
	}
	rank := int(math.Ceil(q / 100 * float64(len(sorted))))
	if rank < 1 {
		rank = 1
	}
	us := float64(sorted[rank-1]) / float64(time.Microsecond)
	return &us
}

func main() {
	address := flag.String("address", "", "server HOST:PORT (required)")
	method := flag.String("method", "/indexer.v1.PrefillMetadata/BuildChunk", "full gRPC method name")
	requestFile := flag.String("request-file", "", "file of the serialized request (required)")
	inFlight := flag.Int("in-flight", 32, "calls in flight in all")
	connections := flag.Int("connections", 4, "connections (one grpc.ClientConn each)")
	seconds := flag.Float64("seconds", 2, "length of the loop in seconds")
	startAt := flag.Float64("start-at", 0, "Unix time (seconds, fractional) to start the loop at, after the warm-up")
	flag.Parse()
	switch {
	case flag.NArg() > 0:
		usage("unexpected arguments %q", flag.Args())
	case *address == "" || *requestFile == "":
		usage("-address and -request-file are required")
	case *inFlight < 1 || *connections < 1:
		usage("-in-flight and -connections must be >= 1")
	case !(*seconds > 0):
		usage("-seconds must be > 0")
	}
	request, err := os.ReadFile(*requestFile)
	if err != nil {
		fail("%v", err)
	}

	conns := make([]*grpc.ClientConn, *connections)
	for i := range conns {
		conns[i], err = grpc.Dial(*address, grpc.WithInsecure(), grpc.WithDisableRetry(),
			grpc.WithDefaultCallOptions(grpc.ForceCodec(rawCodec{}), grpc.MaxCallRecvMsgSize(64<<20)))
		if err != nil {
			fail("dial %s: %v", *address, err)
		}
		defer conns[i].Close()
	}
	call := func(conn *grpc.ClientConn) error {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		var answer []byte
		return conn.Invoke(ctx, *method, &request, &answer)
	}
	for i, conn := range conns {
		if err := call(conn); err != nil {
			fail("warm-up call on connection %d: %v", i, err)
		}
	}
	if wait := time.Until(time.Unix(0, int64(*startAt*1e9))); *startAt > 0 && wait > 0 {
		time.Sleep(wait)
	}

	p := &pool{inFlight: make([]int, *connections), calls: make([]int, *connections)}
	latencies := make([][]time.Duration, *inFlight) // OK calls, one slice per caller
	errors := make([]map[string]int, *inFlight)
	firstErrors := make([]map[string]string, *inFlight) // each code's first message, per caller
	begin := time.Now()
	deadline := begin.Add(time.Duration(*seconds * float64(time.Second)))
	var wg sync.WaitGroup
	for g := 0; g < *inFlight; g++ {
		wg.Add(1)
		errors[g] = map[string]int{}
		firstErrors[g] = map[string]string{}
		go func(g int) {
			defer wg.Done()
			for started := time.Now(); started.Before(deadline); started = time.Now() {
				i := p.acquire()
				err := call(conns[i])
				p.release(i)
				if err != nil {
					code := status.Code(err).String()
					if errors[g][code] == 0 {
						firstErrors[g][code] = status.Convert(err).Message()
					}
					errors[g][code]++
				} else {
					latencies[g] = append(latencies[g], time.Since(started))
				}
			}
		}(g)
	}
	wg.Wait()
	elapsed := time.Since(begin).Seconds()

	var ok []time.Duration
	allErrors := map[string]int{}
	errorMessages := map[string]string{}
	for g := range latencies {
		ok = append(ok, latencies[g]...)
		for code, n := range errors[g] {
			allErrors[code] += n
			if _, seen := errorMessages[code]; !seen {
				errorMessages[code] = firstErrors[g][code]
			}
		}
	}
	sort.Slice(ok, func(a, b int) bool { return ok[a] < ok[b] })
	calls := 0
	for _, n := range p.calls {
		calls += n
	}
	out, _ := json.Marshal(map[string]interface{}{
		"calls":                calls,
		"elapsed":              elapsed,
		"errors":               allErrors,
		"error_messages":       errorMessages,
		"p50_us":               percentileUs(ok, 50),
		"p99_us":               percentileUs(ok, 99),
		"per_connection_calls": p.calls,
	})
	fmt.Println(string(out))
}
