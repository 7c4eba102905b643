// CI client: checks a running indexer-service from Go against the BuildChunk golden cases, a bad request and health.
// Usage: check HOST:PORT PATH/TO/golden-cases.json
// Prints one JSON summary line; exits 1 when anything disagrees, 2 on a usage error (then prints the usage).
// Run by tests/system/test_clients_go.py.
package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"reflect"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	indexerv1 "github.com/indexer-service/indexer-service/clients/go/indexer/v1"
)

type input struct {
	Qsl     []int32 `json:"qsl"`
	SeqLens []int32 `json:"seq_lens"`
	Ratio   int32   `json:"ratio"`
	Start   int32   `json:"start"`
	End     int32   `json:"end"`
	Qslice  []int32 `json:"qslice"`
	Rank    int32   `json:"rank"`
	World   *int32  `json:"world"`
	Inter   *int32  `json:"inter"`
}

type expected struct {
	CuSeqLens            []int32 `json:"cu_seq_lens"`
	TokenToSeq           []int32 `json:"token_to_seq"`
	CuSeqlenKs           []int32 `json:"cu_seqlen_ks"`
	CuSeqlenKe           []int32 `json:"cu_seqlen_ke"`
	LocalCuSeqLens       []int32 `json:"local_cu_seq_lens"`
	TotalSeqLens         int64   `json:"total_seq_lens"`
	TokenStart           int64   `json:"token_start"`
	TokenEnd             int64   `json:"token_end"`
	NumReqs              int32   `json:"num_reqs"`
	SkipKvGather         bool    `json:"skip_kv_gather"`
	LocalTotalSeqLens    int64   `json:"local_total_seq_lens"`
	MaxLocalTotalSeqLens int64   `json:"max_local_total_seq_lens"`
}

type golden struct {
	ChunkMetadata []struct {
		Name     string    `json:"name"`
		Input    input     `json:"input"`
		Expected *expected `json:"expected"`
	} `json:"chunk_metadata"`
}

func toInt32LE(values []int32) []byte {
	out := make([]byte, 4*len(values))
	for i, v := range values {
		binary.LittleEndian.PutUint32(out[4*i:], uint32(v))
	}
	return out
}

func fromInt32LE(b []byte) []int32 {
	out := make([]int32, len(b)/4)
	for i := range out {
		out[i] = int32(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return out
}

func actual(m *indexerv1.ChunkMetadata) *expected {
	if m == nil {
		return nil
	}
	return &expected{
		CuSeqLens: fromInt32LE(m.CuSeqLens), TokenToSeq: fromInt32LE(m.TokenToSeq),
		CuSeqlenKs: fromInt32LE(m.CuSeqlenKs), CuSeqlenKe: fromInt32LE(m.CuSeqlenKe),
		LocalCuSeqLens: fromInt32LE(m.LocalCuSeqLens), TotalSeqLens: m.TotalSeqLens,
		TokenStart: m.TokenStart, TokenEnd: m.TokenEnd, NumReqs: m.NumReqs, SkipKvGather: m.SkipKvGather,
		LocalTotalSeqLens: m.LocalTotalSeqLens, MaxLocalTotalSeqLens: m.MaxLocalTotalSeqLens,
	}
}

const usage = "usage: check HOST:PORT PATH/TO/golden-cases.json"

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, usage)
		os.Exit(2)
	}
	address, goldenPath := os.Args[1], os.Args[2]
	raw, err := os.ReadFile(goldenPath)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var cases golden
	if err := json.Unmarshal(raw, &cases); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	conn, err := grpc.Dial(address, grpc.WithInsecure(),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20)))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	defer conn.Close()
	client := indexerv1.NewPrefillMetadataClient(conn)
	healthClient := healthpb.NewHealthClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	summary := map[string]interface{}{}
	results := map[string]string{}
	problems := []string{}
	for _, c := range cases.ChunkMetadata {
		in := c.Input
		req := &indexerv1.BuildChunkRequest{
			QueryStartLoc: toInt32LE(in.Qsl), SeqLens: toInt32LE(in.SeqLens), CompressRatio: in.Ratio,
			ReqStart: in.Start, ReqEnd: in.End,
		}
		if in.Qslice != nil {
			req.QuerySlice = &indexerv1.QuerySlice{Start: in.Qslice[0], Stop: in.Qslice[1]}
		}
		if in.World != nil {
			req.DcpRank, req.DcpWorldSize, req.DcpInterleave = in.Rank, in.World, in.Inter
		}
		resp, err := client.BuildChunk(ctx, req)
		if err != nil {
			problems = append(problems, fmt.Sprintf("%s: %v", c.Name, err))
			continue
		}
		got := actual(resp.GetMetadata())
		if !reflect.DeepEqual(got, c.Expected) {
			results[c.Name] = "mismatch"
			problems = append(problems, fmt.Sprintf("%s: got %+v, want %+v", c.Name, got, c.Expected))
		} else {
			results[c.Name] = "ok"
		}
	}
	summary["cases"] = results

	// A bad request: 3 bytes is no whole int32.
	_, err = client.BuildChunk(ctx, &indexerv1.BuildChunkRequest{
		QueryStartLoc: toInt32LE([]int32{0, 1}), SeqLens: []byte{1, 2, 3}, ReqEnd: 1,
	})
	st := status.Convert(err)
	summary["bad_request"] = map[string]string{"code": st.Code().String(), "message": st.Message()}

	healthResults := map[string]string{}
	for _, service := range []string{"", "indexer.v1.PrefillMetadata", "no.such.Service"} {
		h, err := healthClient.Check(ctx, &healthpb.HealthCheckRequest{Service: service})
		if err != nil {
			healthResults[service] = status.Code(err).String()
		} else {
			healthResults[service] = h.Status.String()
		}
	}
	summary["health"] = healthResults
	summary["problems"] = problems
	line, _ := json.Marshal(summary)
	fmt.Println(string(line))
	if len(problems) > 0 {
		os.Exit(1)
	}
}
