// The Go baseline of benchmarks/bench_rpc.py: a grpc-go server that answers each known request's bytes with the
// response bytes the service gave for them (the files N.request and N.response of -canned), nothing else. Beside
// the Python echo it shows the stack's limit: what moving exactly these bytes over gRPC costs outside Python.
//
// Build (a static linux/amd64 binary at benchmarks/goecho/bin/goecho, GOPATH mode against Debian's
// /usr/share/gocode, as benchmarks/loadgen):
//
//	python -m benchmarks.goecho
//
// Usage:
//
//	goecho -canned DIR -port-file PATH [-streams 64]
//
// Listens on 127.0.0.1 on a free port, writes {"grpc_port": PORT} to -port-file, serves until SIGTERM or SIGINT.
// Every method is served (an unknown-service handler): bytes in, bytes out. Exit 2: usage error; 1: the canned
// files or the listener failed.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// rawCodec passes a message's bytes through as a *[]byte (named "proto": the content-subtype callers send).
type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) { return *v.(*[]byte), nil }

func (rawCodec) Unmarshal(data []byte, v interface{}) error {
	*v.(*[]byte) = append([]byte(nil), data...)
	return nil
}

func (rawCodec) Name() string { return "proto" }

// String is what grpc.CustomCodec's older Codec interface asks for.
func (rawCodec) String() string { return "proto" }

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, format+"\n", args...)
	os.Exit(1)
}

func main() {
	canned := flag.String("canned", "", "directory of N.request / N.response files")
	portFile := flag.String("port-file", "", "where to write {\"grpc_port\": PORT}")
	streams := flag.Uint("streams", 64, "HTTP/2 streams per connection")
	flag.Parse()
	if *canned == "" || *portFile == "" || flag.NArg() > 0 {
		flag.Usage()
		os.Exit(2)
	}
	answers := map[string][]byte{}
	for n := 0; ; n++ {
		request, err := os.ReadFile(filepath.Join(*canned, fmt.Sprintf("%d.request", n)))
		if os.IsNotExist(err) {
			break
		} else if err != nil {
			fail("%v", err)
		}
		response, err := os.ReadFile(filepath.Join(*canned, fmt.Sprintf("%d.response", n)))
		if err != nil {
			fail("%v", err)
		}
		answers[string(request)] = response
	}
	handler := func(_ interface{}, stream grpc.ServerStream) error {
		var request []byte
		if err := stream.RecvMsg(&request); err != nil {
			return err
		}
		response, ok := answers[string(request)]
		if !ok {
			return status.Error(codes.InvalidArgument, "not a canned request")
		}
		return stream.SendMsg(&response)
	}
	server := grpc.NewServer(
		grpc.UnknownServiceHandler(handler),
		grpc.CustomCodec(rawCodec{}), // ForceServerCodec in newer grpc-go; Debian's has this
		grpc.MaxConcurrentStreams(uint32(*streams)),
		grpc.MaxRecvMsgSize(64<<20),
		grpc.MaxSendMsgSize(64<<20),
	)
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fail("%v", err)
	}
	port, _ := json.Marshal(map[string]int{"grpc_port": listener.Addr().(*net.TCPAddr).Port})
	if err := os.WriteFile(*portFile, port, 0o644); err != nil {
		fail("%v", err)
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-stop
		server.Stop()
	}()
	if err := server.Serve(listener); err != nil {
		fail("%v", err)
	}
}
