// Command pause is the Pod sandbox's process: it holds the Pod's namespaces open and exits
// cleanly when the runtime stops the sandbox.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
}
