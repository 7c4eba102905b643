// Calls BuildChunk (the spec's example E1) and the health check of an indexer-service, and prints the answer.
// Usage: go run ./cmd/example [HOST:PORT]   (after ./generate.sh has generated package indexer/v1)
package main

import (
	"context"
	"encoding/binary"
	"fmt"
	"log"
	"os"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	indexerv1 "github.com/indexer-service/indexer-service/clients/go/indexer/v1"
)

// toInt32LE packs values as the wire wants them: little-endian int32, 4 bytes each, no header.
func toInt32LE(values ...int32) []byte {
	out := make([]byte, 4*len(values))
	for i, v := range values {
		binary.LittleEndian.PutUint32(out[4*i:], uint32(v))
	}
	return out
}

// fromInt32LE reads a little-endian int32 array field.
func fromInt32LE(b []byte) []int32 {
	out := make([]int32, len(b)/4)
	for i := range out {
		out[i] = int32(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return out
}

func main() {
	address := "127.0.0.1:50051"
	if len(os.Args) > 1 {
		address = os.Args[1]
	}
	conn, err := grpc.Dial(address, grpc.WithInsecure(),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20))) // large plans exceed gRPC's 4 MiB default
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()

	h, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "indexer.v1.PrefillMetadata"})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("health:", h.Status)

	resp, err := indexerv1.NewPrefillMetadataClient(conn).BuildChunk(ctx, &indexerv1.BuildChunkRequest{
		QueryStartLoc: toInt32LE(0, 1, 4, 9),
		SeqLens:       toInt32LE(20, 10, 5),
		CompressRatio: 4,
		ReqStart:      1,
		ReqEnd:        3,
	})
	if err != nil {
		st := status.Convert(err) // st.Code() is codes.InvalidArgument for bad input; st.Message() names the field
		log.Fatalf("BuildChunk failed: %s: %s", st.Code(), st.Message())
	}
	m := resp.GetMetadata() // nil when the chunk holds no compressed token
	fmt.Println("cu_seq_lens:", fromInt32LE(m.CuSeqLens))
	fmt.Println("cu_seqlen_ks:", fromInt32LE(m.CuSeqlenKs))
	fmt.Println("cu_seqlen_ke:", fromInt32LE(m.CuSeqlenKe))
	fmt.Println("total_seq_lens:", m.TotalSeqLens)
}
