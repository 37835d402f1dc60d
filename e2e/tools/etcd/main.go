// Command etcd is etcd's own main (go.etcd.io/etcd/v3 main.go), built from the published
// go.etcd.io/etcd/server/v3 module: the etcd root module has replace directives, so it cannot be
// built with `go install ...@version`.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
