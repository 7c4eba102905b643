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
//	loadgen -address HOST:PORT[,HOST:PORT...] -request-file PATH [-method /indexer.v1.PrefillMetadata/BuildChunk]
//	    [-in-flight 32] [-connections 4] [-seconds 2] [-start-at UNIX_EPOCH_SECONDS] [-window BYTES]
//
// The request file holds the serialized request; a codec that passes bytes through sends it as is and keeps the
// answers' bytes unparsed. Each of -connections is its own grpc.ClientConn; each call goes to the ClientConn with
// the fewest calls in flight, ties in turn (indexer_service.client.ChannelPool's rule). With one address a
// ClientConn is one TCP connection (which the kernel's SO_REUSEPORT hands to one worker). With several, a
// ClientConn is what grpc-go, grpc-js and tonic clients do by default with a resolver that returns several
// addresses (a headless Service's DNS name): one connection per address and the round_robin policy, each call on
// the next address; here the list is static (a manual resolver), so the figure is that of a real client minus
// DNS. Every ClientConn is warmed until each address has answered a call, then the loop starts at -start-at (if
// given) and keeps -in-flight calls going for -seconds; calls in flight at the end finish and count. Retries off,
// 64 MiB answers accepted, 60 s deadline per call.
//
// -window (bytes, at least 65535) sets each ClientConn's stream and connection receive windows and turns grpc-go's
// BDP estimation off; 0 (the default) keeps the dynamic windows. Debian's grpc-go (1.33) races a stream's creation
// against a BDP window update (grpc-go issue 5358, fixed in 1.48 by PR 5494): the new stream keeps the old window
// while the server was told the new one, its answer then overruns it, and the call fails with Internal "unexpected
// EOF" (a client-side FLOW_CONTROL_ERROR; about one call in 10,000 at the medium batch on the GPU machine's Xeon).
//
// Prints one JSON line: calls (all finished calls of the loop, warm-up calls excluded), elapsed (seconds, start
// to the last call's end), errors (non-OK calls by gRPC code name), p50_us and p99_us (OK calls, nearest rank;
// null without any), per_connection_calls (by ClientConn) and per_address_calls (by the server address that
// answered). Exit 2: usage error; 1: the warm-up or the request file failed.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
	"google.golang.org/grpc/status"
)

// roundRobin is the service config a client gives its channel to spread calls over every resolved address.
const roundRobin = `{"loadBalancingConfig": [{"round_robin": {}}]}`

// dial opens one ClientConn: to the address itself, or, for several, to all of them through a static resolver
// and round_robin (one connection per address). n names the resolver's scheme, unique per ClientConn.
func dial(addresses []string, n int, options ...grpc.DialOption) (*grpc.ClientConn, error) {
	if len(addresses) == 1 {
		return grpc.Dial(addresses[0], options...)
	}
	builder := manual.NewBuilderWithScheme(fmt.Sprintf("static%d", n))
	state := resolver.State{}
	for _, a := range addresses {
		state.Addresses = append(state.Addresses, resolver.Address{Addr: a})
	}
	builder.InitialState(state)
	options = append(options, grpc.WithResolvers(builder), grpc.WithDefaultServiceConfig(roundRobin))
	return grpc.Dial(builder.Scheme()+":///servers", options...)
}

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
	address := flag.String("address", "", "server HOST:PORT, or several comma-separated for round_robin (required)")
	method := flag.String("method", "/indexer.v1.PrefillMetadata/BuildChunk", "full gRPC method name")
	requestFile := flag.String("request-file", "", "file of the serialized request (required)")
	inFlight := flag.Int("in-flight", 32, "calls in flight in all")
	connections := flag.Int("connections", 4, "connections (one grpc.ClientConn each)")
	seconds := flag.Float64("seconds", 2, "length of the loop in seconds")
	startAt := flag.Float64("start-at", 0, "Unix time (seconds, fractional) to start the loop at, after the warm-up")
	window := flag.Int("window", 0, "stream and connection receive window in bytes, BDP estimation off (0: dynamic)")
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
	case *window != 0 && (*window < 65535 || *window > math.MaxInt32):
		usage("-window must be 0 or from 65535 to %d", math.MaxInt32)
	}
	request, err := os.ReadFile(*requestFile)
	if err != nil {
		fail("%v", err)
	}
	addresses := strings.Split(*address, ",")

	options := []grpc.DialOption{grpc.WithInsecure(), grpc.WithDisableRetry(),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(rawCodec{}), grpc.MaxCallRecvMsgSize(64<<20))}
	if *window > 0 {
		options = append(options, grpc.WithInitialWindowSize(int32(*window)), grpc.WithInitialConnWindowSize(int32(*window)))
	}
	conns := make([]*grpc.ClientConn, *connections)
	for i := range conns {
		conns[i], err = dial(addresses, i, options...)
		if err != nil {
			fail("dial %s: %v", *address, err)
		}
		defer conns[i].Close()
	}
	var byAddressMu sync.Mutex
	byAddress := map[string]int{}
	call := func(conn *grpc.ClientConn, count bool) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		var answer []byte
		var from peer.Peer
		err := conn.Invoke(ctx, *method, &request, &answer, grpc.Peer(&from))
		if from.Addr == nil {
			return "", err
		}
		if count {
			byAddressMu.Lock()
			byAddress[from.Addr.String()]++
			byAddressMu.Unlock()
		}
		return from.Addr.String(), err
	}
	// Warm-up calls on each ClientConn until every address has answered one: round_robin sends every call to the
	// subchannels already READY, so a loop started before the last one connects would load the others more.
	// WaitForReady is not needed: a failed warm-up call is retried here.
	for i, conn := range conns {
		answered := map[string]bool{}
		for try := 0; len(answered) < len(addresses); try++ {
			from, err := call(conn, false)
			if err == nil {
				answered[from] = true
			}
			if try >= 50*len(addresses) && len(answered) < len(addresses) {
				fail("warm-up on connection %d: %d of %d addresses answered; last call: %v",
					i, len(answered), len(addresses), err)
			}
			if len(answered) < len(addresses) {
				time.Sleep(20 * time.Millisecond)
			}
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
				_, err := call(conns[i], true)
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
		"per_address_calls":    byAddress,
	})
	fmt.Println(string(out))
}
