module github.com/indexer-service/indexer-service/clients/go

// The versions Debian 12 packages (the CI build uses them in GOPATH mode, see README.md); newer ones work too.
go 1.19

require (
	github.com/golang/protobuf v1.5.2 // indirect
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)
